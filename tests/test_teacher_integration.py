"""The teacher stage on a local Ray cluster (CPU): the real driver, trainer, rollout and teacher
groups. A teacher actor that dies has its samples counted failed and the run goes on on the
others; with no teacher left the run stops with one line instead of hanging."""

from __future__ import annotations

import math
import time

import pytest

from rlcore.plan.compose import compose

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    yield ray
    ray.shutdown()


def small(tmp_path, teachers: int) -> list[str]:
    # trainer 0.5 + rollout 0.5 + teachers 0.5 each fit the fixture's 2 CPUs
    return [
        f"output_dir={tmp_path}",
        "steps=2",
        "sft.warmup_steps=0",
        "algo.batch_groups=2",
        "algo.group_size=2",
        "rollout.tasks_per_request=2",
        "rollout.max_requests_per_actor=1",
        "trainer.cpus_per_rank=0.5",
        "rollout.cpus_per_actor=0.5",
        "logger.console=false",
        "checkpoint.save_final=false",
        "teacher.enabled=true",
        f"teacher.num_actors={teachers}",
        "teacher.cpus_per_actor=0.5",
        "teacher.max_restarts=0",
        "teacher.score_timeout_s=120",
        "teacher.start_timeout_s=300",
    ]


def test_dead_teacher_actor_samples_count_failed_and_run_goes_on(ray_cluster, tmp_path):
    from actors.driver import Driver
    from rlcore.plan.layout import run_plan
    from rlcore.report.metrics import MetricsLogger

    cfg = compose(small(tmp_path, teachers=2))
    driver = Driver(run_plan(cfg))
    try:
        driver.setup()
        # round robin sends the first scored request to teacher actor 0: it is dead by then
        ray_cluster.kill(driver.teacher.actors[0], no_restart=True)
        history = driver.run(MetricsLogger(cfg.logger, str(tmp_path), {}, cfg.steps))
        assert [h["step"] for h in history] == [1, 2]
        assert sum(h["teacher_failed_step"] for h in history) > 0
        last = history[-1]
        assert last["samples_failed"] >= sum(h["teacher_failed_step"] for h in history)
        assert last["samples_generated"] == (
            last["samples_trained"] + last["samples_dropped_stale"] + last["samples_failed"] + last["samples_in_flight"]
        )
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
    from rlcore.plan.layout import run_plan
    from rlcore.report.metrics import MetricsLogger

    cfg = compose(small(tmp_path, teachers=1))
    driver = Driver(run_plan(cfg))
    try:
        driver.setup()
        ray_cluster.kill(driver.teacher.actors[0], no_restart=True)
        start = time.monotonic()
        with pytest.raises(RunError, match="every teacher actor died"):
            driver.run(MetricsLogger(cfg.logger, str(tmp_path), {}, cfg.steps))
        assert time.monotonic() - start < 60
        assert driver.run_state.acct.failed > 0
        driver.run_state.acct.check()
    finally:
        driver.shutdown()


def test_teacher_actor_reads_the_token_data_and_returns_new_driver_owned_groups(ray_cluster, tmp_path, monkeypatch):
    """The driver-side stage submits metadata only: the teacher actor reads each group's token
    data from the object store and returns the scored groups as new objects; the stage never
    `ray.get`s group data. A score call failing in the actor counts its samples failed under
    the actor's own exception (no crash of the driver); an all-failed group passes unscored."""
    from actors.teacher import TeacherStage
    from rlcore.algo.distill import teacher_sums
    from rlcore.batch.meta import group_meta
    from rlcore.plan.layout import run_plan
    from rlcore.types import Group, Sample, Task

    def sample(prompt, completion, failed=False):
        return Sample(
            prompt, completion, [-1.0] * len(completion), [0] * len(completion), [1] * len(completion), failed=failed
        )

    def meta(samples, index):
        return group_meta(Group(Task(f"t{index}", []), samples, stream_index=index), ray_cluster.put(samples))

    real_get, fetched = ray_cluster.get, []

    def recording_get(refs, *args, **kwargs):
        fetched.extend(refs if isinstance(refs, list) else [refs])
        return real_get(refs, *args, **kwargs)

    cfg = compose(small(tmp_path, teachers=1))
    added, failed = [], []

    def take(events):  # what the driver does with the stage's events
        added.extend(events.scored)
        failed.extend(events.failed)

    stage = TeacherStage(run_plan(cfg))
    try:
        stage.start()
        ok = meta([sample([3, 4], [5, 6, 7]), sample([], [], failed=True)], 0)
        all_failed = meta([sample([], [], failed=True)], 1)
        out_of_vocab = meta([sample([3], [10_000])], 2)  # the engine's embedding raises in the actor
        monkeypatch.setattr(ray_cluster, "get", recording_get)
        for g in (ok, all_failed, out_of_vocab):
            take(stage.submit([g]))
        assert stage.waiting_groups() == 2  # the all-failed one passed on at once
        # what a checkpoint puts back of the groups at the teacher (`Driver.teacher_groups`)
        assert [(g.stream_index, g.task) for g in stage.groups()] == [(0, ok.task), (2, out_of_vocab.task)]
        deadline = time.monotonic() + 120
        while stage.refs() and time.monotonic() < deadline:
            ready, _ = ray_cluster.wait(stage.refs(), num_returns=1, timeout=1.0)
            for ref in ready:
                take(stage.on_ready(ref))
            take(stage.expire())
        monkeypatch.undo()
        assert not stage.refs() and stage.waiting_groups() == 0
        data_refs = {ok.data, all_failed.data, out_of_vocab.data} | {g.data for g in added}
        assert not data_refs & set(fetched)  # the stage read return 0 of its calls only
        assert added[0] is all_failed
        assert len(failed) == 1 and failed[0][0] == 1
        assert failed[0][1] == "teacher: IndexError: index out of range in self"
        (scored,) = added[1:]
        assert scored.data != ok.data and scored.stream_index == 0 and scored.task == ok.task
        samples = ray_cluster.get(scored.data, timeout=30)
        assert len(samples[0].teacher_logprobs) == 3 and samples[1].teacher_logprobs is None
        assert all(math.isfinite(x) and x < 0 for x in samples[0].teacher_logprobs)
        s = samples[0]
        want = teacher_sums(s.logprobs, s.teacher_logprobs, s.loss_mask)
        assert scored.samples[0].teacher_sums == pytest.approx(want)
        assert scored.samples[1].teacher_sums is None
        assert ray_cluster.get(ok.data, timeout=30)[0].teacher_logprobs is None  # the submitted data untouched
        assert stage.step_metrics(1.0)["teacher_failed_step"] == 1
    finally:
        stage.shutdown()


def test_top_k_distillation_runs_end_to_end(ray_cluster, tmp_path):
    """`teacher.top_k`: the teacher actor returns its top-k with the scored groups, they travel
    through the object store to the trainer rank, and every step reports the top-k KL and both
    sides' mass on the k tokens (pure top-k distillation: no other advantage)."""
    from actors.driver import Driver
    from rlcore.plan.layout import run_plan
    from rlcore.report.metrics import MetricsLogger

    cfg = compose(small(tmp_path, teachers=1) + ["teacher.top_k=4", "teacher.kl_coef=0", "teacher.reward_coef=0"])
    driver = Driver(run_plan(cfg))
    try:
        driver.setup()
        history = driver.run(MetricsLogger(cfg.logger, str(tmp_path), {}, cfg.steps))
        assert [h["step"] for h in history] == [1, 2]
        for h in history:
            # a random-weight teacher differs from the student: a positive, finite top-k KL
            assert math.isfinite(h["teacher_top_k_kl"]) and h["teacher_top_k_kl"] > 0, h
            assert 0 < h["teacher_top_k_mass"] <= 1 + 1e-6 and 0 < h["student_top_k_mass"] <= 1 + 1e-6, h
            assert h["grad_norm"] > 0  # the top-k term alone trains
    finally:
        driver.shutdown()
