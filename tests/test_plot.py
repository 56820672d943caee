"""rlcore.report.plot on the metrics.jsonl of a real (short, CPU) run: the run writes its own plot, the
CLI overlays several runs, and panels a run did not log are left out."""

import contextlib
import io
import json
import struct

import pytest

from rlcore.report.plot import PANELS, plot_runs, read_run
from rlcore.report.plot import main as plot_main
from rlcore.run import main

ALL_PANELS = [p.title for p in PANELS]


def png_size(path) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR chunk, after checking the 8-byte signature."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", data[:8]
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


@pytest.fixture(scope="module")
def real_run(tmp_path_factory):
    """A short run of the embedded default through the CLI's main (in this process)."""
    out = tmp_path_factory.mktemp("runs") / "async"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = main(
            [
                "steps=3",
                "sft.warmup_steps=0",
                "algo.batch_groups=4",
                "eval.every_n_steps=2",
                "eval.at_start=true",
                "eval.num_tasks=4",
                "eval.samples_per_task=2",
                "eval.k=[1,2]",
                "checkpoint.save_final=false",
                "logger.console=false",
                f"output_dir={out}",
            ]
        )
    assert code == 0, printed.getvalue()[-2000:]
    assert f"plot: {out / 'plot.png'}" in printed.getvalue(), printed.getvalue()[-2000:]  # the run summary
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
def test_cli_overlays_runs_and_skips_missing_metrics(real_run, tmp_path, capsys):
    # a second run dir holding only part of the real rows' metrics (as an SFT run would)
    other = tmp_path / "sync"
    other.mkdir()
    rows = [json.loads(line) for line in (real_run / "metrics.jsonl").read_text().splitlines()]
    keep = ("step", "elapsed_s", "loss", "reward_mean")
    (other / "metrics.jsonl").write_text(
        "".join(json.dumps({k: r[k] for k in keep if k in r}) + "\n" for r in rows if "loss" in r) + '{"step": 4, "lo'
    )
    assert plot_runs([other], tmp_path / "partial.png") == ["reward", "loss"]
    assert png_size(tmp_path / "partial.png") == (1080, round(2 * 2.6 * 90))

    assert plot_main([str(real_run), str(other), "-o", str(tmp_path / "both.png")]) == 0
    assert f"({', '.join(ALL_PANELS)})" in capsys.readouterr().out
    assert png_size(tmp_path / "both.png") == (1080, round(8 * 2.6 * 90))

    assert plot_main([str(tmp_path / "nowhere")]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err


def test_eval_at_start_needs_periodic_evaluation():
    from rlcore.plan.compose import compose
    from rlcore.plan.validate import problems

    assert ("eval.at_start", "evaluates only in a run with periodic evaluation (eval.every_n_steps > 0)") in problems(
        compose(["eval.at_start=true"])
    )
    assert not [k for k, _ in problems(compose(["eval.at_start=true", "eval.every_n_steps=5"])) if k.startswith("eval")]


def test_an_eval_only_run_has_a_wall_clock(tmp_path):
    """`mode=eval` of a checkpoint logs eval rows only (no train rows to take a clock from): the
    wall-clock column uses the evaluations' own time, so its panel is not empty."""
    rows = [{"step": 200, "eval/reward_mean": 0.58, "eval/pass@1": 0.0, "eval/time_s": 42.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = read_run(tmp_path)
    assert [r["elapsed_s"] for r in run.evals] == [42.0]
    assert plot_runs([tmp_path], tmp_path / "plot.png") == ["eval reward"]
