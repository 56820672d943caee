"""A run folder holds one run: a lock against a second run, no empty output_dir, a resume never
leaves two series in one file, and an interrupt (Ctrl-C, SIGTERM) keeps a checkpoint."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlcore.plan.interrupt import StopRequest
from rlcore.run import main
from rlcore.storage.rundir import LOCK_FILE, hold_output_dir

REPO = Path(__file__).resolve().parent.parent


def test_a_second_run_into_a_held_folder_is_refused_before_ray(tmp_path, capsys):
    out = tmp_path / "run"
    lock = hold_output_dir(out)  # a live run holds it (no metrics yet: it started seconds ago)
    try:
        start = time.perf_counter()
        assert main(["steps=1", f"output_dir={out}"]) == 2
        assert time.perf_counter() - start < 30  # refused before Ray or any actor starts
    finally:
        lock.close()
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("rlcore:")]
    assert len(err) == 1 and "output_dir" in err[0] and f"in use by another run (pid {os.getpid()})" in err[0], err
    assert "ray" not in sys.modules or not sys.modules["ray"].is_initialized()


def test_the_lock_goes_with_its_process_even_killed(tmp_path):
    out = tmp_path / "run"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path; "
            "from rlcore.storage.rundir import hold_output_dir; lock = hold_output_dir(Path(sys.argv[1])); "
            "print('held', flush=True); time.sleep(600)",
            str(out),
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RuntimeError, match=f"pid {holder.pid}"):
            hold_output_dir(out)
    finally:
        holder.kill()  # SIGKILL: no cleanup code runs
        holder.wait(30)
    hold_output_dir(out).close()
    assert (out / LOCK_FILE).read_text().strip() == str(os.getpid())


def test_an_empty_output_dir_is_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["steps=1", "output_dir="]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("rlcore: config error: output_dir: is empty"), err
    assert list(tmp_path.iterdir()) == []


def _write_series(out: Path, steps: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for name in ("metrics.jsonl", "data_order.jsonl", "samples.jsonl"):
        (out / name).write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, steps + 1)))


def test_a_resume_without_checkpoint_over_rows_is_refused_and_keeps_them(tmp_path, capsys):
    out = tmp_path / "run"
    _write_series(out, 32)  # an earlier attempt logged 32 steps and kept no checkpoint
    before = {name: (out / name).read_text() for name in ("metrics.jsonl", "data_order.jsonl", "samples.jsonl")}
    assert main(["steps=1", f"output_dir={out}", "resume=true"]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("rlcore:")]
    assert len(err) == 1 and err[0].startswith(
        "rlcore: config error: checkpoint.resume: true found no complete checkpoint in"
    ), err
    assert "32 row(s) of metrics.jsonl" in err[0] and "nothing was changed" in err[0]
    assert {name: (out / name).read_text() for name in before} == before
    assert "ray" not in sys.modules or not sys.modules["ray"].is_initialized()
    # a broken newest checkpoint is no checkpoint: the rows are kept the same way
    (out / "checkpoints" / "step_00000032" / "trainer").mkdir(parents=True)
    assert main(["steps=1", f"output_dir={out}", "resume=true"]) == 2
    assert {name: (out / name).read_text() for name in before} == before


def test_first_signal_asks_a_graceful_driver_to_stop_second_stops_at_once(capsys):
    before = signal.getsignal(signal.SIGTERM)  # SIG_DFL, or Ray's own after a ray.init in this process
    stop = StopRequest(graceful=True).install()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)  # the handler runs between bytecodes of the main thread
        assert stop.requested and stop.signal_name == "SIGTERM"
        assert "SIGTERM received: stopping after the step in flight" in capsys.readouterr().err
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.01)
    finally:
        stop.restore()
    assert signal.getsignal(signal.SIGTERM) is before


@pytest.mark.parametrize("in_ray_job", [False, True])
def test_the_sigterm_line_says_how_to_stop_at_once_where_the_run_is(in_ray_job, capsys, monkeypatch):
    monkeypatch.delenv("RAY_JOB_CONFIG_JSON_ENV_VAR", raising=False)
    monkeypatch.delenv("RAY_JOB_STOP_WAIT_TIME_S", raising=False)
    if in_ray_job:  # what Ray's job supervisor sets in a job's driver
        monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", '{"runtime_env": {}}')
        monkeypatch.setenv("RAY_JOB_STOP_WAIT_TIME_S", "60")
    stop = StopRequest(graceful=True).install()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)
    finally:
        stop.restore()
    err = capsys.readouterr().err
    assert stop.requested and "SIGTERM received: stopping after the step in flight" in err
    if in_ray_job:  # nobody can press Ctrl-C in a job: Ray kills it after its wait
        assert "Ctrl-C" not in err and "in a Ray Job, Ray kills it 60 s after the stop" in err, err
    else:
        assert "press Ctrl-C again to stop at once" in err


def test_sigterm_without_a_graceful_driver_ends_like_ctrl_c():
    stop = StopRequest(graceful=False).install()
    try:
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.01)
        assert stop.signal_name == "SIGTERM"
    finally:
        stop.restore()


def _steps(path: Path) -> list[int]:
    return [
        json.loads(ln)["step"]
        for ln in path.read_text().splitlines()
        if ln.strip() and not any(k.startswith("eval/") for k in json.loads(ln))
    ]


def test_sigterm_saves_a_checkpoint_and_resume_continues_one_series(tmp_path):
    """A scheduler's SIGTERM mid-run: one rlcore line, a checkpoint of the last finished step,
    exit 130; `resume=true` then continues the same series (no second 1..N)."""
    out = tmp_path / "run"
    args = [
        sys.executable,
        "-m",
        "rlcore.run",
        "steps=200",
        "sft.warmup_steps=0",
        "eval.every_n_steps=0",
        "checkpoint.export_final=false",
        f"output_dir={out}",
    ]
    proc = subprocess.Popen(
        args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 400
        while time.monotonic() < deadline and proc.poll() is None:
            if (out / "metrics.jsonl").is_file() and len(_steps(out / "metrics.jsonl")) >= 3:
                break
            time.sleep(0.5)
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        os.kill(proc.pid, signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, stderr[-3000:]
    assert "SIGTERM received: stopping after the step in flight" in stderr
    assert "*** SIGTERM" not in stderr and "Traceback" not in stderr, stderr[-3000:]
    done = _steps(out / "metrics.jsonl")
    assert done == list(range(1, len(done) + 1)) and len(done) < 200
    assert f"SIGTERM: stopped after step {done[-1]} of 200; checkpoint" in stderr, stderr[-3000:]
    assert (out / "checkpoints" / f"step_{done[-1]:08d}" / "meta.json").is_file()

    more = len(done) + 2
    resumed = subprocess.run(
        [*args[:3], f"steps={more}", *args[4:], "resume=true"], cwd=REPO, capture_output=True, text=True, timeout=400
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert _steps(out / "metrics.jsonl") == list(range(1, more + 1))
    assert [json.loads(ln)["step"] for ln in (out / "data_order.jsonl").read_text().splitlines()] == list(
        range(1, more + 1)
    )
