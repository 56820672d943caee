"""A trainer rank killed mid-run: the driver restarts the trainer group and the run goes on
(`actors.recovery`). From the last checkpoint (`trainer.heal_from=checkpoint`): the run exits
normally, metrics.jsonl holds steps 1..N once each, the accounting identity holds on every row,
and steps after the restart equal a run stopped and resumed at that checkpoint (the resume test's
exactness). With nothing configured (no checkpoint at all): the new ranks take the engines'
weights and no step is lost."""

import json
import threading
import time

import pytest

from rlcore.plan.compose import compose
from rlcore.plan.validate import validate

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def ray_cluster():
    """One local Ray for the module's runs (each run's driver makes and removes its own actors)."""
    import ray

    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    yield ray
    ray.shutdown()


STEPS = 8
SYNC = [
    "algo.max_off_policy_steps=0",
    "algo.batch_groups=4",
    "algo.group_size=4",
    "rollout.tasks_per_request=2",
    "rollout.sampling.max_new_tokens=8",
    "logger.console=false",
    "sft.warmup_steps=0",
    "checkpoint.interval=2",
    "trainer.heal_from=checkpoint",
]


def run(overrides, kill_at_version=None, kill_at_step=None):
    """One in-process run; with `kill_at_version` (`kill_at_step`), trainer rank 0 is killed once
    the engines serve that version (the run has done that many steps). Returns the driver and the
    run's history."""
    import ray

    from actors.driver import Driver
    from rlcore.plan.layout import run_plan
    from rlcore.report.metrics import MetricsLogger

    cfg = compose(overrides)
    validate(cfg)
    driver = Driver(run_plan(cfg))
    logger = MetricsLogger(cfg.logger, cfg.output_dir, {}, cfg.steps)

    def kill_trainer():
        while (
            driver.run_state.version < kill_at_version if kill_at_step is None else driver.run_state.step < kill_at_step
        ):
            time.sleep(0.05)
        ray.kill(driver.trainers.handles[0], no_restart=True)

    try:
        driver.setup()
        if kill_at_version is not None or kill_at_step is not None:
            threading.Thread(target=kill_trainer, daemon=True).start()
        history = driver.run(logger)
    finally:
        logger.close()
        driver.shutdown()
    return driver, history


def rows(out, name="metrics.jsonl"):
    return [json.loads(line) for line in (out / name).read_text().splitlines()]


def test_a_killed_trainer_rank_restarts_from_the_checkpoint_and_the_run_goes_on(ray_cluster, tmp_path):
    a, b = tmp_path / "healed", tmp_path / "resumed"
    driver, history = run([*SYNC, f"output_dir={a}", f"steps={STEPS}"], kill_at_version=5)
    assert driver.recovery.restarts == 1
    step, seconds = driver.recovery.last
    assert step in (4, 6)  # the newest checkpoint before the death
    print(f"trainer recovery: restarted from step {step} in {seconds:.1f}s")
    # the reference: stopped at that checkpoint, then resumed
    run([*SYNC, f"output_dir={b}", f"steps={step}"])
    run([*SYNC, f"output_dir={b}", f"steps={STEPS}", "resume=true"])

    assert [r["step"] for r in history] == list(range(1, STEPS + 1))
    healed = [r for r in rows(a) if "loss" in r]
    assert [r["step"] for r in healed] == list(range(1, STEPS + 1))  # one series, no gap, no duplicate
    for r in healed:
        assert r["samples_generated"] == (
            r["samples_trained"]
            + r["samples_dropped_stale"]
            + r["samples_failed"]
            + r["samples_in_flight"]
            + r["samples_filtered"]
        ), r
        assert r["trainer_restarts"] == (0 if r["step"] <= step else 1), r
    assert healed[-1]["samples_failed"] == 0  # nothing was lost: what was in flight was generated again
    assert rows(a, "data_order.jsonl") == rows(b, "data_order.jsonl")
    resumed = {r["step"]: r for r in rows(b) if "loss" in r}
    for r in healed:
        for key in ("loss", "reward_mean", "entropy", "grad_norm", "policy_version", "samples_trained"):
            assert r[key] == pytest.approx(resumed[r["step"]][key], rel=1e-6, abs=1e-9), (r["step"], key)
    assert healed[-1]["samples_generated"] == resumed[STEPS]["samples_generated"]


def test_a_killed_trainer_rank_heals_from_the_engines_with_nothing_configured(ray_cluster, tmp_path, caplog):
    """The default job (checkpoint.interval=0: no checkpoint exists) loses neither the run nor a
    step: before, the death stopped it ('no checkpoint existed to restart it from')."""
    out = tmp_path / "default"
    with caplog.at_level("WARNING", logger="rlcore"):
        driver, history = run([f"output_dir={out}", f"steps={STEPS}", "logger.console=false"], kill_at_step=3)
    assert driver.recovery.restarts == 1 and driver.recovery.source == "engines"
    step, seconds = driver.recovery.last
    # no checkpoint to go back to: checkpoint.interval=0 writes only the final one (save_final)
    assert driver.cfg.checkpoint.interval == 0
    assert [p.name for p in out.glob("checkpoints/step_*")] == [f"step_{STEPS:08d}"]
    print(f"trainer recovery from the engines' weights: at step {step} in {seconds:.1f}s")
    said = [r.getMessage() for r in caplog.records if "restarted the trainer group" in r.getMessage()]
    assert len(said) == 1 and "from the weights of rollout actor" in said[0], said
    assert "no step lost; the optimizer state was reset" in said[0], said
    assert [r["step"] for r in history] == list(range(1, STEPS + 1))
    healed = [r for r in rows(out) if "loss" in r]
    assert [r["step"] for r in healed] == list(range(1, STEPS + 1))  # nothing cut back, nothing twice
    for r in healed:
        assert r["samples_generated"] == (
            r["samples_trained"]
            + r["samples_dropped_stale"]
            + r["samples_failed"]
            + r["samples_in_flight"]
            + r["samples_filtered"]
        ), r
        assert r["trainer_restarts"] == (0 if r["step"] <= step else 1), r
    # the version follows the optimizer steps: each logged step moved it by one from where it was
    assert healed[-1]["policy_version"] >= STEPS
    assert all(r["loss"] == r["loss"] for r in healed)  # finite (not NaN) after the restart


def test_the_restart_counters_go_on_counting_after_a_resume(ray_cluster, tmp_path):
    """`trainer_restarts` counts the run's restarts over its submissions, as `samples_failed` does:
    before, a resume (e.g. of a Ray Job whose driver died) started the counters again at 0, so the
    last row said the run had never restarted (issue 42's chaos run through Ray Jobs)."""
    out = tmp_path / "run"
    fast = [f"output_dir={out}", "logger.console=false", "sft.warmup_steps=0"]
    driver, _ = run([*fast, "steps=4"], kill_at_step=2)
    assert driver.recovery.restarts == 1
    resumed, _ = run([*fast, "steps=6", "resume=true"])
    assert resumed.recovery.restarts == 0  # trainer.max_restarts bounds one submission's restarts
    series = [r for r in rows(out) if "loss" in r]
    assert [r["step"] for r in series] == list(range(1, 7))
    step = driver.recovery.last[0]
    assert [r["trainer_restarts"] for r in series] == [0 if r["step"] <= step else 1 for r in series], series
