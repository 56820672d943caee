"""`actors.stall_watch.StallWatch` on a real actor whose process is stopped (SIGSTOP) and
continued: named once silent for `stall_s`, answering again after SIGCONT; a dead actor is not
"answering". Frozen nodes in a run: tests/test_multinode.py -k frozen."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration


def test_a_stopped_actor_is_named_after_stall_s_and_answers_again_after_sigcont():
    import ray

    from actors.stall_watch import StallWatch

    @ray.remote(max_concurrency=2)
    class Engine:
        def ready(self) -> int:
            return 0

        def pid(self) -> int:
            return os.getpid()

    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    try:
        actors = [Engine.remote(), Engine.remote()]
        pids = ray.get([a.pid.remote() for a in actors])
        watch = StallWatch(actors, stall_s=3.0)

        def poll(seconds: float) -> list:
            seen, end = [], time.monotonic() + seconds
            while time.monotonic() < end:
                seen += watch.stalled([0, 1])
                time.sleep(0.2)
            return seen

        assert poll(4.0) == []  # both answer
        assert watch.answering(0) and watch.answering(1)
        os.kill(pids[0], signal.SIGSTOP)
        try:
            time.sleep(2.5)  # the question asked before the stop may have been answered: wait a beat
            seen = poll(8.0)
        finally:
            os.kill(pids[0], signal.SIGCONT)
        assert seen and {i for i, _ in seen} == {0}, seen  # only the stopped one
        assert all(s > 3.0 for _, s in seen)
        assert not watch.answering(0, within_s=2.0) and watch.answering(1)
        end = time.monotonic() + 10.0
        while not watch.answering(0) and time.monotonic() < end:  # back: it answers again
            poll(0.5)
        assert watch.answering(0)
        assert poll(3.0) == []
        ray.kill(actors[1], no_restart=True)
        time.sleep(1.0)
        poll(3.0)
        assert not watch.answering(1, within_s=2.0)  # a dead actor's error is not an answer
    finally:
        ray.shutdown()


def rollout_actor_pid(out: Path, index: int) -> int | None:
    """The process of rollout actor `index` of the run writing to `out` (its stdout is
    OUTPUT_DIR/logs/rollout-INDEX.log, `actors.logs`)."""
    log = str(out / "logs" / f"rollout-{index}.log")
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.readlink(f"/proc/{pid}/fd/1") == log:
                return int(pid)
        except OSError:  # gone, or not ours to read
            continue
    return None


@pytest.mark.timeout(900)
def test_a_run_whose_engine_froze_across_its_checkpoints_finishes_and_resumes_from_them(tmp_path):
    """`python -m rlcore.run` with two engines, one frozen (SIGSTOP) from step 1 to the run's end,
    a checkpoint every step: the frozen engine is named and taken out as a stall, each checkpoint's
    RNG read leaves it out (saved as missing) instead of stopping the run, and the run finishes.
    `resume=true` from those checkpoints (one engine's RNG state missing) trains on: steps 1..N
    once, every line valid JSON."""
    out = tmp_path / "run"
    overrides = [f"output_dir={out}", "rollout.num_actors=2", "checkpoint.interval=1", "cluster.num_cpus=3"]
    log_path = tmp_path / "run.log"
    run = subprocess.Popen([sys.executable, "-m", "rlcore.run", "steps=5", *overrides],
                           stdout=open(log_path, "w"), stderr=subprocess.STDOUT)
    pid = None
    try:
        deadline = time.monotonic() + 400
        metrics = out / "metrics.jsonl"
        while run.poll() is None and time.monotonic() < deadline:
            if pid is None and metrics.is_file() and metrics.read_text().strip():
                pid = rollout_actor_pid(out, 1)
                if pid is not None:
                    os.kill(pid, signal.SIGSTOP)
            time.sleep(0.2)
        run.wait(timeout=60)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait(timeout=30)
        if pid is not None:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
    log = log_path.read_text()
    assert pid is not None, log[-3000:]
    assert run.returncode == 0, log[-4000:]
    named = [ln for ln in log.splitlines() if "rollout actor 1" in ln and "no progress for" in ln]
    assert len(named) == 1, log[-4000:]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5] and rows[-1]["rollout_stalls"] == 1, rows[-1]
    missing = [ln for ln in log.splitlines() if "engine RNG state of rollout actor 1" in ln]
    print(f"frozen engine: {named[0]}; {len(missing)} RNG read line(s): {missing[:1]}")

    resumed = subprocess.run([sys.executable, "-m", "rlcore.run", "steps=7", "resume=true", *overrides],
                             capture_output=True, text=True, timeout=400)
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-4000:]
    for series in ("metrics.jsonl", "events.jsonl"):
        for line in (out / series).read_text().splitlines():
            json.loads(line)  # every line whole
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == list(range(1, 8))
