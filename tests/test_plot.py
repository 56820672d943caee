"""rlcore.plot on the metrics.jsonl of a real (short, CPU) run: the run writes its own plot, the
CLI overlays several runs, and panels a run did not log are left out."""

import json
import struct
import subprocess
import sys

import pytest

from rlcore.plot import PANELS, plot_runs, read_run

ALL_PANELS = [p.title for p in PANELS]


def png_size(path) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR chunk, after checking the 8-byte signature."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", data[:8]
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


@pytest.fixture(scope="module")
def real_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "async"
    proc = subprocess.run(
        [sys.executable, "-m", "rlcore.run", "steps=3", "sft.warmup_steps=0", "algo.batch_groups=4",
         "eval.every_n_steps=2", "eval.at_start=true", "eval.num_tasks=4", "eval.samples_per_task=2", "eval.k=[1,2]",
         "checkpoint.save_final=false", "logger.console=false", f"output_dir={out}"],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"plot in {out / 'plot.png'}" in proc.stdout, proc.stdout[-2000:]
    return out


@pytest.mark.integration
def test_finished_run_writes_its_plot(real_run):
    run = read_run(real_run)
    assert [r["step"] for r in run.steps] == [1, 2, 3]
    # the starting policy (eval.at_start), every 2 steps, and after the last
    assert [r["step"] for r in run.evals] == [0, 2, 3]
    assert run.evals[0]["elapsed_s"] == 0.0 and all("elapsed_s" in r for r in run.evals)
    width, height = png_size(real_run / "plot.png")
    # one row per panel, two columns (step, wall-clock): 8 rows of 2.6 in at 90 dpi, 12 in wide
    assert (width, height) == (1080, round(8 * 2.6 * 90))
    assert (real_run / "plot.png").stat().st_size > 50_000


@pytest.mark.integration
def test_cli_overlays_runs_and_skips_missing_metrics(real_run, tmp_path):
    # a second run dir holding only part of the real rows' metrics (as an SFT run would)
    other = tmp_path / "sync"
    other.mkdir()
    rows = [json.loads(line) for line in (real_run / "metrics.jsonl").read_text().splitlines()]
    keep = ("step", "elapsed_s", "loss", "reward_mean")
    (other / "metrics.jsonl").write_text("".join(
        json.dumps({k: r[k] for k in keep if k in r}) + "\n" for r in rows if "loss" in r) + '{"step": 4, "lo')
    assert plot_runs([other], tmp_path / "partial.png") == ["reward", "loss"]
    assert png_size(tmp_path / "partial.png") == (1080, round(2 * 2.6 * 90))

    proc = subprocess.run([sys.executable, "-m", "rlcore.plot", str(real_run), str(other), "-o",
                           str(tmp_path / "both.png")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert f"({', '.join(ALL_PANELS)})" in proc.stdout
    assert png_size(tmp_path / "both.png") == (1080, round(8 * 2.6 * 90))

    proc = subprocess.run([sys.executable, "-m", "rlcore.plot", str(tmp_path / "nowhere")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "no metrics.jsonl" in proc.stderr


def test_eval_at_start_needs_periodic_evaluation():
    from rlcore.run import compose
    from rlcore.validate import problems
    assert ("eval.at_start", "evaluates only in a run with periodic evaluation (eval.every_n_steps > 0)") in \
        problems(compose(["eval.at_start=true"]))
    assert not [k for k, _ in problems(compose(["eval.at_start=true", "eval.every_n_steps=5"])) if k.startswith("eval")]
