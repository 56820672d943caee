"""The teacher stage on a local Ray cluster (CPU): the real driver, trainer, rollout and teacher
groups. A teacher actor that dies has its samples counted failed and the run goes on on the
others; with no teacher left the run stops with one line instead of hanging."""

from __future__ import annotations

import math
import time

import pytest

from rlcore.run import compose

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def ray_cluster():
    import ray
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    yield ray
    ray.shutdown()


def small(tmp_path, teachers: int) -> list[str]:
    # trainer 0.5 + rollout 0.5 + teachers 0.5 each fit the fixture's 2 CPUs
    return [f"output_dir={tmp_path}", "steps=2", "sft.warmup_steps=0", "algo.batch_groups=2", "algo.group_size=2",
            "rollout.tasks_per_request=2", "rollout.max_requests_per_actor=1", "trainer.cpus_per_rank=0.5",
            "rollout.cpus_per_actor=0.5", "logger.console=false", "checkpoint.save_final=false",
            "teacher.enabled=true", f"teacher.num_actors={teachers}", "teacher.cpus_per_actor=0.5",
            "teacher.max_restarts=0", "teacher.score_timeout_s=120", "teacher.start_timeout_s=300"]


def test_dead_teacher_actor_samples_count_failed_and_run_goes_on(ray_cluster, tmp_path):
    from actors.driver import Driver
    from rlcore.metrics import MetricsLogger

    cfg = compose(small(tmp_path, teachers=2))
    driver = Driver(cfg)
    try:
        driver.setup()
        # round robin sends the first scored request to teacher actor 0: it is dead by then
        ray_cluster.kill(driver.teacher.actors[0], no_restart=True)
        history = driver.run(MetricsLogger(cfg.logger, str(tmp_path), {}, cfg.steps))
        assert [h["step"] for h in history] == [1, 2]
        assert sum(h["teacher_failed_step"] for h in history) > 0
        last = history[-1]
        assert last["samples_failed"] >= sum(h["teacher_failed_step"] for h in history)
        assert last["samples_generated"] == (last["samples_trained"] + last["samples_dropped_stale"]
                                             + last["samples_failed"] + last["samples_in_flight"])
        assert driver.teacher.alive == [False, True]
        for h in history:
            # a random-weight teacher differs from the student: a positive, finite reverse KL
            assert math.isfinite(h["teacher_kl"]) and h["teacher_kl"] > 0
            assert 0 <= h["teacher_busy_frac"] <= 1
        # a step in which no score call finished reports no latency
        latencies = [h["teacher_latency_s"] for h in history if h["teacher_latency_s"] is not None]
        assert latencies and all(x > 0 for x in latencies)
    finally:
        driver.shutdown()


def test_no_teacher_left_stops_the_run_without_hanging(ray_cluster, tmp_path):
    from actors.driver import Driver, RunError
    from rlcore.metrics import MetricsLogger

    cfg = compose(small(tmp_path, teachers=1))
    driver = Driver(cfg)
    try:
        driver.setup()
        ray_cluster.kill(driver.teacher.actors[0], no_restart=True)
        start = time.monotonic()
        with pytest.raises(RunError, match="every teacher actor died"):
            driver.run(MetricsLogger(cfg.logger, str(tmp_path), {}, cfg.steps))
        assert time.monotonic() - start < 60
        assert driver.acct.failed > 0
        driver.acct.check()
    finally:
        driver.shutdown()
