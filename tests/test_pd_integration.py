"""Prefill/decode disaggregation on a local Ray cluster (CPU, the transformers engine): the
rollout level (a decode actor's router hands each generate call to a prefill actor, the cache
comes back through the object store, and what it samples is what one engine samples) and a whole
`python -m rlcore.run` with a prefill actor and a decode actor each killed mid-run."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from rlcore.plan.compose import compose
from tests.test_chaos import rollout_actor_pid

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parent.parent
PD = ["rollout.pd.enabled=true", "rollout.cpus_per_actor=0.5", "rollout.pd.prefill_cpus_per_actor=0.5"]


def test_disaggregated_rollout_samples_what_one_engine_samples(tmp_path):
    """Decode actor 0 (its router prefills on actor 1) and prefill actor 1 generating alone, the
    same tasks and request seed: the same tokens and logprobs (greedy, and sampled)."""
    import ray

    from actors.groups import place
    from rlcore.types import Task

    cfg = compose([f"output_dir={tmp_path}", *PD])
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    try:
        groups = place(cfg, trainer=False)
        decode, prefill = groups.rollouts
        tasks = [Task(id=f"t{i}", messages=[{"role": "user", "content": "abcdef"[:i + 2]}], answer="") for i in range(3)]
        for temperature in (0.0, 1.0):  # greedy, and sampled with the request's seed
            sampling = {"temperature": temperature}
            split, alone = ray.get([decode.generate_groups.remote(tasks, 2, "train", 11, sampling),
                                    prefill.generate_groups.remote(tasks, 2, "train", 11, sampling)], timeout=300)
            got = [[(s.completion_ids, s.logprobs) for s in g.samples] for g in split]
            assert got == [[(s.completion_ids, s.logprobs) for s in g.samples] for g in alone], temperature
            assert not any(s.failed for g in split for s in g.samples)
            assert all(s.completion_ids for g in split for s in g.samples)
        log = (tmp_path / "logs" / "rollout-1.log").read_text()
        assert "rollout actor 1 (prefill): first prefill served" in log  # the split path ran
        groups.remove()
    finally:
        ray.shutdown()


def test_disaggregated_run_trains_and_survives_a_prefill_and_a_decode_death(tmp_path):
    """1 prefill + 1 decode actor through the CLI; the prefill actor is SIGKILLed after step 2 and
    the decode actor once the prefill one is back: every step is trained, the sample identity
    holds on every row, both deaths are counted and named."""
    out = tmp_path / "run"
    out.mkdir()
    metrics, driver_log = out / "metrics.jsonl", out / "driver.log"
    steps, killed = 8, []
    with driver_log.open("w") as err:
        run = subprocess.Popen([sys.executable, "-m", "rlcore.run", f"output_dir={out}", f"steps={steps}", *PD,
                                "cluster.num_cpus=2", "logger.console=false"],
                               cwd=REPO, stdout=subprocess.DEVNULL, stderr=err, text=True)

    def killer():  # the prefill actor (index 1), then the decode actor (index 0) once 1 rejoined
        while len(killed) < 2 and run.poll() is None:
            if not killed:
                due = metrics.exists() and len(metrics.read_text().splitlines()) >= 2
            else:
                due = "rollout actor 1 rejoined the weight group" in driver_log.read_text()
            pid = rollout_actor_pid(out, 1 - len(killed), None) if due else None
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
    thread.join(5)
    log = driver_log.read_text()
    assert run.returncode == 0, log[-3000:]
    assert len(killed) == 2, log[-3000:]
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for r in rows:
        assert r["samples_generated"] == (r["samples_trained"] + r["samples_dropped_stale"] + r["samples_failed"]
                                          + r["samples_in_flight"] + r["samples_filtered"])
    assert rows[-1]["rollout_restarts"] >= 2
    assert "rollout actor 1 (prefill) died" in log and "rollout actor 0 (decode) died" in log
    assert "rollout actor 0 rejoined the weight group" in log
    assert "first prefill served" in (out / "logs" / "rollout-1.log").read_text()
