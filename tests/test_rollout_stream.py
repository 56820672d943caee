"""A generate request's groups reach the driver as each is scored (`actors.rollout_stream`),
through real rollout actors on a local Ray: a reward that hangs delays its own group only, and
the groups a request never delivers (actor death, timeout) are counted once, as failed, while
the ones it delivered stay (their token data outlives the actor). The hang here is a gate the
test opens (`tests.chaos_env:GatedReverseText`), so no clock decides the outcome."""

import time

import pytest

from actors.rollout import RolloutWorker
from actors.rollout_group import RolloutGroup
from actors.run_state import RunState, TaskFeed
from rlcore.batch.buffer import Accounting, RolloutBuffer
from rlcore.envs import build_env
from rlcore.plan.compose import compose
from rlcore.plan.layout import run_plan
from rlcore.report.failures import FailureLog

pytestmark = pytest.mark.integration
GROUP = 2


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    yield ray
    ray.shutdown()


@pytest.fixture
def rollouts(ray_cluster, tmp_path):
    """One real rollout actor whose reward hangs on task 0 of the request until `gate` exists."""
    gate = tmp_path / "gate"
    cfg = compose(
        [
            f"output_dir={tmp_path / 'run'}",
            "rollout.num_actors=1",
            "rollout.tasks_per_request=4",
            f"algo.group_size={GROUP}",
            "env.name=tests.chaos_env:GatedReverseText",
            f"+env.args.gate={gate}",
            "env.reward.timeout_s=300",
            "rollout.sampling.max_new_tokens=4",
        ]
    )
    actor = ray_cluster.remote(RolloutWorker).options(num_cpus=0, max_concurrency=4, max_restarts=0).remote(cfg, 0)
    ray_cluster.get(actor.ready.remote(), timeout=300)
    acct = Accounting()
    run = RunState(acct, TaskFeed(build_env(cfg.env), cfg))
    group = RolloutGroup(run_plan(cfg), [actor], run, RolloutBuffer(1, 100, acct), FailureLog(0))
    yield group, gate, acct
    gate.touch()  # the hung reward returns, whatever the test did
    ray_cluster.kill(actor)


def collect(ray, group: RolloutGroup, until, timeout_s: float = 120.0) -> list:
    """Read the group's streams as the driver does until `until(groups so far)` (or the timeout)."""
    got: list = []
    deadline = time.monotonic() + timeout_s
    while not until(got) and time.monotonic() < deadline:
        ready = ray.wait(group.refs(), num_returns=1, timeout=1.0)[0] if group.refs() else []
        for gen in ready + [g for g in group.held() if g not in ready]:
            got += group.collect(gen)
    return got


def test_a_hung_reward_delays_its_own_group_only(ray_cluster, rollouts):
    group, gate, acct = rollouts
    group.launch(allowed=4, queued_elsewhere=0)
    first = collect(ray_cluster, group, lambda got: len(got) >= 3)
    assert sorted(g.stream_index for g in first) == [1, 2, 3], "the groups scored did not come while task 0 hung"
    assert not gate.exists() and len(group.pending) == 1 and group.queued_tasks() == 1
    assert [i for i, _ in group.unfinished()] == [0]  # a checkpoint would put back the hung task only
    for g in first:
        group.buffer.add(g)
        assert len(g.samples) == GROUP and not any(s.failed for s in g.samples)
    acct.check()
    assert acct.in_flight == 4 * GROUP
    gate.touch()
    (last,) = collect(ray_cluster, group, lambda got: not group.pending)
    assert last.stream_index == 0 and not any(s.failed for s in last.samples) and not group.pending
    group.buffer.add(last)
    acct.check()
    assert acct.failed == 0 and group.queued_tasks() == 0
    data = ray_cluster.get([g.data for g in [*first, last]], timeout=60)
    assert [[len(s.completion_ids) for s in d] for d in data] == [
        [s.completion_len for s in g.samples] for g in [*first, last]
    ]


def three_delivered(ray_cluster, group) -> list:
    """Launch the request and buffer the three groups that score while task 0's reward hangs."""
    group.launch(allowed=4, queued_elsewhere=0)
    first = collect(ray_cluster, group, lambda got: len(got) >= 3)
    assert len(first) == 3
    for g in first:
        group.buffer.add(g)
    return first


def test_an_actor_death_mid_request_fails_only_the_groups_not_delivered(ray_cluster, rollouts):
    group, gate, acct = rollouts
    first = three_delivered(ray_cluster, group)
    ray_cluster.kill(group.handles[0], no_restart=True)
    assert collect(ray_cluster, group, lambda got: not group.pending) == [] and not group.pending
    acct.check()
    assert acct.failed == GROUP and acct.in_flight == 3 * GROUP  # the hung group only; 3 buffered
    assert group.serving == [] and group.restarts == 1
    assert group.failures.step_metrics()["failed_by_reason"] == {"engine: ActorDiedError": GROUP}
    data = ray_cluster.get([g.data for g in first], timeout=60)  # made by the dead actor, owned by the driver
    assert [len(d) for d in data] == [GROUP] * 3


def test_an_overdue_request_fails_only_the_groups_not_delivered(ray_cluster, rollouts):
    group, gate, acct = rollouts
    three_delivered(ray_cluster, group)
    group.timeout_s = 0.0
    group.expire()
    assert not group.pending and group.queued_tasks() == 0
    acct.check()
    assert acct.failed == GROUP and acct.in_flight == 3 * GROUP


def test_engine_rng_states_skip_an_engine_that_died_since_it_was_serving(rollouts, ray_cluster):
    """A checkpoint reads every serving engine's RNG state; one whose actor died a moment before
    (its node lost mid-checkpoint) is kept as None, like an engine not serving, and the run goes on."""
    group, gate, _ = rollouts
    gate.touch()
    doomed = ray_cluster.remote(RolloutWorker).options(num_cpus=0, max_restarts=0).remote(group.cfg, 1)
    ray_cluster.get(doomed.ready.remote(), timeout=300)
    ray_cluster.kill(doomed)
    both = RolloutGroup(run_plan(group.cfg), [group.handles[0], doomed], group.run, group.buffer, FailureLog(0))
    states = both.rng_states()
    assert states[0] is not None and states[1] is None


def test_an_engine_frozen_during_a_checkpoints_rng_read_is_a_stall_and_the_checkpoint_goes_on(
    rollouts, ray_cluster, caplog
):
    """SIGSTOP of a rollout actor's process while a checkpoint reads the engines' RNG states: the
    stall watcher, asked while it waits, names it within seconds and takes it out as a stall
    (`rollout_stalls`); its state is kept as missing and the read returns, the checkpoint goes on
    (it used to wait 60 s unseen, then stop the run naming no actor)."""
    import logging
    import os
    import signal

    group, gate, _ = rollouts
    gate.touch()
    frozen = (
        ray_cluster.remote(RolloutWorker).options(num_cpus=0, max_concurrency=4, max_restarts=0).remote(group.cfg, 1)
    )
    ray_cluster.get(frozen.ready.remote(), timeout=300)
    pid = ray_cluster.get(frozen.__ray_call__.remote(lambda self: os.getpid()), timeout=60)
    both = RolloutGroup(run_plan(group.cfg), [group.handles[0], frozen], group.run, group.buffer, FailureLog(0))
    both.watch()  # heartbeats asked, as the driver's loop does between steps
    time.sleep(0.5)
    os.kill(pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="rlcore"):
            states = both.rng_states(timeout_s=120.0)
        took = time.monotonic() - start
    finally:
        os.kill(pid, signal.SIGCONT)
        ray_cluster.kill(frozen)
    lines = [r.getMessage() for r in caplog.records]
    assert states[0] is not None and states[1] is None
    assert took < 30.0, f"the frozen engine held the checkpoint {took:.0f}s"
    assert any("rollout actor 1" in ln and "no progress" in ln for ln in lines), lines
    assert any(
        "waiting for the engine RNG state of rollout actor 1" in ln and "checkpoint.timeout_s" in ln for ln in lines
    ), lines
    assert both.stalled_count == 1 and both.serving == [0]


def test_token_data_left_as_its_dead_actors_error_is_lost_and_a_slow_read_is_raised(ray_cluster):
    """`fetch_token_data` on a trainer rank: a ref the driver holds whose value became the error
    of the actor that made it (seen after an engine kill, Ray 2.60) names that group lost, so the
    step runs again without it; a read past its deadline is raised (the rank's own fault)."""
    from actors.trainer import fetch_token_data

    @ray_cluster.remote(num_cpus=0, max_restarts=0)
    class Maker:
        def make(self, n: int) -> list[int]:
            return list(range(n))

        def hang(self) -> None:
            time.sleep(600)

    maker = Maker.remote()
    good = maker.make.remote(3)
    ray_cluster.get(good, timeout=60)
    dying = maker.hang.remote()
    ray_cluster.kill(maker, no_restart=True)
    assert fetch_token_data([good, dying], 30) == (
        None,
        [1],
        "lost with the actor that made it (ActorDiedError)",
    )
    assert fetch_token_data([good], 30) == ([[0, 1, 2]], [], "")
    slow = Maker.remote()
    with pytest.raises(ray_cluster.exceptions.GetTimeoutError):
        fetch_token_data([good, slow.hang.remote()], 1)
    ray_cluster.kill(slow)
