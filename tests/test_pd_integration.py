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
import warnings
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
    from rlcore.plan.layout import run_plan
    from rlcore.types import Task

    cfg = compose([f"output_dir={tmp_path}", *PD])
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    try:
        groups = place(run_plan(cfg), trainer=False)
        decode, prefill = groups.rollouts
        tasks = [
            Task(id=f"t{i}", messages=[{"role": "user", "content": "abcdef"[: i + 2]}], answer="") for i in range(3)
        ]
        for temperature in (0.0, 1.0):  # greedy, and sampled with the request's seed
            sampling = {"temperature": temperature}
            split, alone = ray.get(
                [
                    decode.generate_groups.remote(tasks, 2, "train", 11, sampling),
                    prefill.generate_groups.remote(tasks, 2, "train", 11, sampling),
                ],
                timeout=300,
            )
            got = [[(s.completion_ids, s.logprobs) for s in g.samples] for g in split]
            assert got == [[(s.completion_ids, s.logprobs) for s in g.samples] for g in alone], temperature
            assert not any(s.failed for g in split for s in g.samples)
            assert all(s.completion_ids for g in split for s in g.samples)
        log = (tmp_path / "logs" / "rollout-1.log").read_text()
        assert "rollout actor 1 (prefill): first prefill served" in log  # the split path ran
        versions_rule_under_updates(cfg, tmp_path, decode, prefill, tasks)
        groups.remove()
    finally:
        ray.shutdown()


def versions_rule_under_updates(cfg, tmp_path, decode, prefill, tasks):
    """Requests on the decode actor while updates land on one pool, then the other (each order in
    turn), then the driver's release (`release_version`): a prefill ahead of the decode engine,
    one behind it, and both ahead of the release. From the engines' own per-token versions: no
    sample's first token (its prefill's version) and second (the decode engine's first forward on
    that cache) differ; the router's counts show each window was met."""
    import ray
    import torch.distributed.checkpoint as dcp

    from rlcore.models.build import build_model, build_tokenizer
    from rlcore.storage.checkpoint import TRAINER_DIR

    ckpt = tmp_path / "ckpt"
    with warnings.catch_warnings():  # one process, as intended
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(
            {"model": build_model(cfg.model, build_tokenizer(cfg.model)).state_dict()},
            checkpoint_id=str(ckpt / TRAINER_DIR),
            no_dist=True,
        )
    done = threading.Event()

    def updates():
        try:
            for v in range(1, 5):
                for h in (prefill, decode) if v % 2 else (decode, prefill):
                    ray.get(h.load_checkpoint_weights.remote(str(ckpt), v), timeout=120)
                    time.sleep(0.5)
                ray.get(decode.release_version.remote(v), timeout=60)
        finally:
            done.set()

    thread = threading.Thread(target=updates, daemon=True)
    thread.start()
    samples, k = [], 0
    while not done.is_set():
        refs = [decode.generate_groups.remote(tasks, 2, "train", 100 + k + i) for i in range(3)]
        samples += [s for gs in ray.get(refs, timeout=300) for g in gs for s in g.samples]
        k += 3
    thread.join(5)
    assert not any(s.failed for s in samples), next(s.error for s in samples if s.failed)
    pairs = [s.versions[:2] for s in samples if len(s.versions) >= 2]
    assert all(p == d for p, d in pairs), [(p, d) for p, d in pairs if p != d]
    assert len({p for p, _ in pairs}) >= 3, pairs  # requests ran through the updates
    stats = ray.get(decode.pd_stats.remote(), timeout=60)
    assert stats.get("held") and stats.get("reprefilled", 0) + stats.get("behind", 0), stats


def test_disaggregated_run_trains_and_survives_a_prefill_and_a_decode_death(tmp_path):
    """1 prefill + 1 decode actor through the CLI; the prefill actor is SIGKILLed after step 2,
    the decode actor once the prefill one is back, and then the prefill actor frozen (SIGSTOP)
    until the driver names it, then let go (SIGCONT): every step is trained, the sample identity
    holds on every row, both deaths and the stall are counted and named, the frozen prefill
    engine rejoins, and no sample's prefill and decode versions differ."""
    out = tmp_path / "run"
    out.mkdir()
    metrics, driver_log = out / "metrics.jsonl", out / "driver.log"
    steps, killed, frozen = 12, [], []
    with driver_log.open("w") as err:
        run = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "rlcore.run",
                f"output_dir={out}",
                f"steps={steps}",
                *PD,
                "cluster.num_cpus=2",
                "logger.console=false",
                "logger.samples_every=1",
                "logger.samples_per_table=64",
                "rollout.stall_timeout_s=6",
            ],
            cwd=REPO,
            stdout=subprocess.DEVNULL,
            stderr=err,
            text=True,
        )

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
        # then the prefill actor freezes once the decode actor rejoined, until the driver names it
        while not frozen and run.poll() is None:
            pid = (
                rollout_actor_pid(out, 1, None)
                if "rollout actor 0 rejoined the weight group" in driver_log.read_text()
                else None
            )
            if pid is not None:
                os.kill(pid, signal.SIGSTOP)
                frozen.append(pid)
            time.sleep(0.1)
        try:
            while frozen and run.poll() is None and "rollout actor 1 (prefill) on node" not in driver_log.read_text():
                time.sleep(0.1)
        finally:
            for pid in frozen:
                os.kill(pid, signal.SIGCONT)

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
    assert len(killed) == 2 and len(frozen) == 1, log[-3000:]
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for r in rows:
        assert r["samples_generated"] == (
            r["samples_trained"]
            + r["samples_dropped_stale"]
            + r["samples_failed"]
            + r["samples_in_flight"]
            + r["samples_filtered"]
        )
    assert rows[-1]["rollout_restarts"] >= 2
    assert "rollout actor 1 (prefill) died" in log and "rollout actor 0 (decode) died" in log
    assert "rollout actor 0 rejoined the weight group" in log
    assert "rollout actor 1 (prefill) on node" in log and "no progress" in log  # the frozen one, named
    after = log.split("rollout actor 1 (prefill) on node")[1]
    assert "rollout actor 1 rejoined the weight group" in after and "after it stalled" in after
    assert rows[-1]["rollout_stalls"] >= 1
    assert "first prefill served" in (out / "logs" / "rollout-1.log").read_text()
    # the version rule, from the engines' own per-token versions: a sample's first token is the
    # prefill engine's, its second the decode engine's first forward on that cache; syncs landed
    # while requests were in flight (samples of several versions), and never split the two
    shown = [r for r in map(json.loads, (out / "samples.jsonl").read_text().splitlines()) if "failed_reason" not in r]
    pairs = [r["token_versions"][:2] for r in shown if len(r["token_versions"]) >= 2]
    assert len(pairs) > 20 and len({v for v, _ in pairs}) >= 3, pairs
    assert all(p == d for p, d in pairs), [(p, d) for p, d in pairs if p != d]
    assert all(r["version"] == r["token_versions"][0] for r in shown if r["token_versions"])  # staleness's version
