"""Chaos (issue 22): the default job with rewards that raise, hang, busy-loop, return junk and
print megabytes, plus a rollout actor killed (SIGKILL) twice, as a whole `python -m rlcore.run`
process: every step is trained once, no step waits for a deadline (a weight-group operation
held by the dead engine is given up, `rlcore.transfer.broadcast.abort`), the sample identity
holds on every row, every failure is counted under its reason, and reward still rises. A reward
that always raises stops the run with one line instead of spinning. What the faults cost against
a clean run is a benchmark's figure (`benchmarks/chaos_overhead.py`), not asserted here."""

import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.actor_process import actor_pid

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parent.parent
STEPS = 24  # room for two restarts (a new process: Python, torch, the model) on a loaded machine
# A reverse_text reward takes well under a millisecond: 0.2 s is still hundreds of times that, and
# it bounds what each hung or busy-looping reward costs its request (a busy loop in a thread holds
# the GIL against the engine's decode steps until its deadline)
REWARD_TIMEOUT_S = 0.2
COMMON = [
    f"steps={STEPS}",
    "rollout.num_actors=2",
    "rollout.cpus_per_actor=0.5",
    "cluster.num_cpus=2",
    "logger.console=false",
]


def rollout_actor_pid(out: Path, index: int, not_pid: int | None) -> int | None:
    """The process of rollout actor `index` of the run writing to `out`, other than `not_pid`."""
    return actor_pid(out, "rollout", index, not_pid)


def run_job(tmp_path, name, overrides, kill_at: int = 0, kills: int = 0):
    """Run the job as its own process, start to exit; SIGKILL rollout actor 1's process once
    metrics.jsonl has `kill_at` rows, and again (up to `kills` times) each time the driver says
    that actor is back in the weight group. Returns (wall seconds, rows, driver log)."""
    out = tmp_path / name
    out.mkdir(parents=True)
    metrics, driver_log = out / "metrics.jsonl", out / "driver.log"
    killed: list[int] = []
    start = time.monotonic()
    with driver_log.open("w") as err:
        run = subprocess.Popen(
            [sys.executable, "-m", "rlcore.run", f"output_dir={out}", *COMMON, *overrides],
            cwd=REPO,
            stdout=subprocess.DEVNULL,
            stderr=err,
            text=True,
        )

    def due() -> bool:
        if not killed:
            return metrics.exists() and len(metrics.read_text().splitlines()) >= kill_at
        return driver_log.read_text().count("rollout actor 1 rejoined the weight group") >= len(killed)

    def killer():
        while len(killed) < kills and run.poll() is None:
            pid = rollout_actor_pid(out, 1, killed[-1] if killed else None) if due() else None
            if pid is not None:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            time.sleep(0.1)

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    try:
        run.wait(timeout=600)
    finally:
        if run.poll() is None:
            run.kill()
    took = time.monotonic() - start
    thread.join(5)
    log = driver_log.read_text()
    assert run.returncode == 0, log[-3000:]
    assert len(killed) == kills, (killed, log[-3000:])
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert len(rows) == STEPS
    return took, rows, log


# the chaos run's deadline for a weight-group operation: a step that waited for one would take
# this long, an order of magnitude past any step's time here (1-10 s at load 1-30)
SYNC_DEADLINE_S = 240


def test_chaos_run_trains_every_step_explains_failures_and_learns(tmp_path):
    load = os.getloadavg()[0]
    chaos_s, rows, log = run_job(
        tmp_path,
        "chaos",
        [
            "env.name=tests.chaos_env:ChaosReverseText",
            f"env.reward.timeout_s={REWARD_TIMEOUT_S}",
            f"rollout.weight_sync_timeout_s={SYNC_DEADLINE_S}",
        ],
        kill_at=2,
        kills=2,
    )
    log_bytes = sum(p.stat().st_size for p in (tmp_path / "chaos" / "logs").glob("*") if p.is_file())
    steps = [round(r["step_time_s"], 1) for r in rows]
    print(
        f"chaos run {chaos_s:.1f}s at load {load:.1f} -> {os.getloadavg()[0]:.1f}; steps {steps}; "
        f"actor logs {log_bytes / 1e6:.1f} MB"
    )
    # a kill that lands while the weight group forms or syncs once left the trainer in that
    # operation until its deadline (120 s by default: one step of 121.8 s in a CI run)
    assert max(steps) < SYNC_DEADLINE_S / 2, steps
    assert rows[-1]["rollout_restarts"] >= 2
    for r in rows:
        assert r["samples_generated"] == (
            r["samples_trained"]
            + r["samples_dropped_stale"]
            + r["samples_failed"]
            + r["samples_in_flight"]
            + r["samples_filtered"]
        )
        assert sum(r["failed_by_reason"].values()) == r["samples_failed_step"]  # every failure has a reason
    reasons = set().union(*(r["failed_by_reason"] for r in rows))
    for expected in (
        "reward: timeout after",
        "reward: ValueError: reward bug on reverse_text/train/#",
        "not a number",
        "engine: ",
    ):
        assert any(expected in k for k in reasons), (expected, reasons)
    # while the killed actor restarted, the driver kept training: it rejoined at a later version
    died = [int(v) for v in re.findall(r"rollout actor 1 died at version (\d+)", log)]
    rejoined = [int(v) for v in re.findall(r"rollout actor 1 rejoined the weight group at version (\d+)", log)]
    assert len(died) == 2 and rejoined and all(r > d for d, r in zip(died, rejoined)), (died, rejoined)
    # hung threads are asked to stop and end: at most one request's worth is ever alive (before
    # the fix they piled up by thousands)
    assert max(r["reward_threads_abandoned"] for r in rows) <= 64
    assert log_bytes < 20e6  # 1 MB prints per call stayed out of the actors' logs
    # learning goes on: the least-squares line through the rewards of all steps rises. Its rise
    # over the run measured 0.034-0.076 (clean runs 0.043-0.052) with per-step noise of 0.016-0.023,
    # so the bound is ~2.5 sd of the fitted rise below the usual figure; the earlier check (means
    # of the first and last 3 steps, 0.02 apart) failed about one run in ten on that noise alone
    rewards = [r["reward_mean"] for r in rows]
    rise = statistics.linear_regression(range(len(rewards)), rewards).slope * (len(rewards) - 1)
    assert rise > 0.01, (rise, rewards)


def test_reward_that_always_raises_stops_the_run_in_one_line(tmp_path):
    start = time.monotonic()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlcore.run",
            f"output_dir={tmp_path}",
            "steps=3",
            "sft.warmup_steps=0",
            "env.name=tests.chaos_env:AlwaysRaises",
            "rollout.stop_after_failed_requests=4",
            "logger.console=false",
            "cluster.num_cpus=2",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    took = time.monotonic() - start
    print(f"stopped after {took:.1f}s: {proc.stderr.strip().splitlines()[-1:]}")
    assert proc.returncode == 1, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("rlcore: error:")]
    assert len(errors) == 1
    assert "no progress" in errors[0] and "KeyError: 'answer'" in errors[0] and "checkpoint" in errors[0]
    assert "first of its kind" in proc.stderr and "task reverse_text/" in proc.stderr
