"""End to end on a local Ray cluster (CPU): the real driver, trainer group and rollout group."""

import json
import subprocess
import sys

import pytest
import torch

from actors.rollout_stream import Stream, launch_stream
from rlcore.plan.compose import compose

pytestmark = pytest.mark.integration

REQUIRED = {
    "step",
    "reward_mean",
    "loss",
    "entropy",
    "mismatch_kl",
    "policy_version",
    "max_staleness",
    "tokens_per_s",
    "step_time_s",
    "samples_generated",
    "samples_trained",
    "samples_dropped_stale",
    "samples_failed",
    "samples_in_flight",
}


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    yield ray
    ray.shutdown()


def test_fsdp_two_ranks_weights_reach_engine(ray_cluster, tmp_path):
    """Two FSDP2 ranks (gloo) train; after every sync the engine holds exactly the trainer's
    full weights, and the accounting identity holds."""
    from actors.driver import Driver
    from rlcore.models.build import build_model, build_tokenizer
    from rlcore.plan.layout import run_plan
    from rlcore.report.metrics import MetricsLogger
    from rlcore.types import Task

    cfg = compose(
        [
            f"output_dir={tmp_path}",
            "steps=2",
            "trainer.world_size=2",
            "trainer.cpus_per_rank=0.5",
            "sft.warmup_steps=0",
            "algo.batch_groups=4",
            "rollout.tasks_per_request=4",
            "logger.console=false",
        ]
    )
    driver = Driver(run_plan(cfg))
    try:
        driver.setup()
        ray = ray_cluster
        # full_state is a collective: call every rank before waiting
        trainer_state = ray.get([tr.full_state.remote() for tr in driver.trainers.handles], timeout=120)[0]
        engine_state = ray.get(driver.groups.rollouts[0].state_dict.remote(), timeout=60)
        for name, t in trainer_state.items():
            assert torch.equal(engine_state[name], t), name

        history = driver.run(MetricsLogger(cfg.logger, str(tmp_path), {}, cfg.steps))
        assert [h["policy_version"] for h in history] == [1, 2]
        refs = [tr.full_state.remote() for tr in driver.trainers.handles]
        trainer_state = ray.get(refs, timeout=120)[0]
        engine_state = ray.get(driver.groups.rollouts[0].state_dict.remote(), timeout=60)
        for name, t in trainer_state.items():
            assert torch.equal(engine_state[name], t), name
        assert ray.get(driver.groups.rollouts[0].policy_version.remote(), timeout=60) == 2
        # training moved the weights away from the initial ones
        fresh = build_model(cfg.model, build_tokenizer(cfg.model)).state_dict()
        assert sum(not torch.equal(fresh[n], t) for n, t in trainer_state.items() if n in fresh) > 0
        # a generate request after the sync carries the new version on every token
        groups = ray.get(
            driver.groups.rollouts[0].generate_groups.remote(
                [Task(id="x", messages=[{"role": "user", "content": "abc"}], answer="cba")], 2
            ),
            timeout=60,
        )
        assert {v for s in groups[0].samples for v in s.versions} == {2}
        # refs, not data: the driver fetches a request's metadata only; the token data it owns
        # outlives the rollout actor that made it (a trainer rank reads it after a restart)
        tasks = [Task(id=f"y{i}", messages=[{"role": "user", "content": "abcd"[: i + 2]}], answer="") for i in range(2)]
        stream = Stream(0, tasks, 3, 0.0, launch_stream(driver.groups.rollouts[0], tasks, 3, seed=1), [0, 1], 0)
        metas, ended = [], None
        for _ in range(600):  # read as the driver does, until the stream ends (60 s at most)
            ray.wait([stream.gen], timeout=0.1)
            got, ended = stream.read()
            metas += got
            if ended is not None:
                break
        assert ended is not None and ended.error is None and sorted(stream.arrived) == [0, 1]
        metas.sort(key=lambda m: m.stream_index)
        data_refs = [m.data for m in metas]
        ray.kill(driver.groups.rollouts[0], no_restart=True)
        data = ray.get(data_refs, timeout=60)
        assert [len(d) for d in data] == [len(m.samples) for m in metas] == [3, 3]
        assert [[(s.completion_len, s.loss_tokens) for s in m.samples] for m in metas] == [
            [(len(s.completion_ids), sum(s.loss_mask)) for s in d] for d in data
        ]
        last = history[-1]
        assert last["samples_generated"] == (
            last["samples_trained"] + last["samples_dropped_stale"] + last["samples_failed"] + last["samples_in_flight"]
        )
    finally:
        driver.shutdown()


def test_cli_run_writes_metrics(tmp_path):
    """The default job through the CLI, named by its recipe: `+recipe=reverse_text` is the embedded
    default with its own output_dir and steps, both overridden here. One run is both this test's
    and the single-turn recipe's (test_recipe_rl_steps_through_full_loop runs the multi-turn one)."""
    out = tmp_path / "run"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlcore.run",
            "+recipe=reverse_text",
            "steps=3",
            f"output_dir={out}",
            "profile.steps=[2]",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    # profile.steps: step 2 of the trainer rank and the engine on one timeline, summed up at the end
    windows = [json.loads(line) for line in (out / "profile" / "windows.jsonl").read_text().splitlines()]
    assert [w["step"] for w in windows] == [2] and windows[0]["processes"] == ["engine0", "trainer0"]
    for source in ("engine0", "trainer0"):
        assert list((out / "profile" / source).glob("step2*.json.gz")), source
    assert "profile: step 2, " in proc.stdout and "(2 of 2 processes recorded in it)" in proc.stdout
    assert "trainer rank 0" in proc.stdout and "engine 0" in proc.stdout  # CPU ops of each (no GPU here)
    again = subprocess.run(
        [sys.executable, "-m", "rlcore.timeline", str(out)], capture_output=True, text=True, timeout=120
    )
    assert again.returncode == 0 and "profile: step 2, " in again.stdout, again.stderr
    for r in rows:
        assert REQUIRED <= set(r), REQUIRED - set(r)
        assert r["batch_samples"] > 0 and r["loss_tokens"] > 0  # the recipe's steps train
        assert r["max_staleness"] <= 1
        assert 0.0 <= r["zero_adv_frac"] <= 1.0 and r["generate_time_s"] >= 0.0
    assert "engine_mismatch_kl" in rows[0]  # step 1 trains on samples of the weights it holds
    assert all("engine_mismatch_kl" in r or "staleness_kl" in r for r in rows)
    # the canary's bounds were calibrated on the first sync; each later sync's canary runs beside
    # the next step and is logged with the sync after it (its version named), the last at the end
    checked = [r for r in rows if "canary_mean_gap" in r]
    assert [r["canary_version"] for r in checked] == [r["policy_version"] - 1 for r in rows[1:]], checked
    assert all(
        r["canary_mean_gap"] <= r["canary_mean_limit"] and r["canary_max_gap"] <= r["canary_max_limit"] for r in checked
    )
    assert len({r["canary_mean_limit"] for r in checked}) == 1
    assert "canary bounds mean gap" in proc.stdout
    assert (out / "config.yaml").exists()
    # the console: start-up phases, step lines with grad_norm, the summary; no Ray noise
    console = proc.stdout + proc.stderr
    for phase in (
        "starting Ray",
        "placing actors",
        "starting the trainer",
        "starting the rollout engine",
        "first weight sync",
        "canary calibrated on the sync to version",
    ):
        assert f"rlcore: {phase}" in console, phase
    assert "grad_norm" in proc.stdout and "rlcore: done: 3 steps" in proc.stdout
    assert "  start-up " in proc.stdout and "  reward " in proc.stdout
    assert "Token authentication" not in console
    assert "(pid=" not in console  # actors' output is not forwarded to the console ...
    assert (out / "logs" / "trainer-0.log").is_file() and (out / "logs" / "rollout-0.log").is_file()  # ... but kept
    for log in (out / "logs").glob("*.log"):  # and hold no library's warning or error a user cannot act on
        text = log.read_text()
        assert "Warning" not in text and "ERROR" not in text, (log.name, text[-2000:])


@pytest.mark.parametrize("recipe", ["alphabet_sort"])
def test_recipe_rl_steps_through_full_loop(recipe, tmp_path):
    """A few RL steps of a multi-turn builtin environment through the CLI. The single-turn one
    (reverse_text) is test_cli_run_writes_metrics's run: one run of that recipe, both checks."""
    out = tmp_path / recipe
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlcore.run",
            f"+recipe={recipe}",
            "steps=2",
            "sft.warmup_steps=0",
            "checkpoint.save_final=false",
            f"output_dir={out}",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["batch_samples"] > 0 and r["loss_tokens"] > 0 for r in rows)
