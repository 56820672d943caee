"""RolloutGroup.launch (actors.rollout_group): requests go round-robin to the serving actors only,
never past the staleness bound the driver gives nor past `REQUESTS_PER_SLOT` x
`rollout.max_requests_per_actor` per serving actor that delivered no group yet (generating or
waiting for a slot), nor past `RequestLimits.held` in all, in data order and counted as launched; a
group still scoring long after its request's others came leaves the bound's count
(`rlcore.batch.stragglers`); `expire` counts an overdue request failed.
The actors here record the calls instead of generating (the real path: tests/test_integration.py)."""

import pytest

from actors.rollout_group import RolloutGroup
from actors.run_state import RunState, TaskFeed
from rlcore.batch.buffer import Accounting, RolloutBuffer
from rlcore.envs import build_env
from rlcore.plan.compose import compose
from rlcore.plan.layout import run_plan
from rlcore.report.failures import FailureLog


class Call:
    def __init__(self, actor, calls):
        self.actor, self.calls = actor, calls

    def options(self, num_returns):
        assert num_returns == "streaming"
        return self

    def remote(self, tasks, group_size, split, seed):
        self.calls.append((self.actor, len(tasks), seed))
        return object()  # stands for the request's stream (never read here)


class Actor:
    def __init__(self, index, calls):
        self.generate_stream = Call(index, calls)


@pytest.fixture
def group():
    cfg = compose(
        ["rollout.num_actors=3", "rollout.tasks_per_request=2", "rollout.max_requests_per_actor=2", "algo.group_size=4"]
    )
    calls: list = []
    acct = Accounting()
    env = build_env(cfg.env)
    run = RunState(acct, TaskFeed(env, cfg))
    g = RolloutGroup(
        run_plan(cfg),
        [Actor(i, calls) for i in range(3)],
        run,
        RolloutBuffer(1, 100, acct),
        FailureLog(cfg.rollout.stop_after_failed_requests),
    )
    return g, calls, run


def test_launch_stops_at_the_staleness_bound_and_goes_round_robin(group):
    g, calls, run = group
    g.launch(allowed=5, queued_elsewhere=0)  # 2 + 2 + 1 tasks
    assert [(a, n) for a, n, _ in calls] == [(0, 2), (1, 2), (2, 1)]
    assert run.request_seq == 3 and run.feed.next_index == 5 and run.acct.in_flight == 5 * 4
    g.launch(allowed=5, queued_elsewhere=0)  # nothing more: the bound is reached
    assert len(calls) == 3
    seeds = [s for _, _, s in calls]
    assert seeds == [run.feed.seed([0]), run.feed.seed([2]), run.feed.seed([4])]  # seeded by data index


def test_launch_skips_actors_not_serving_and_caps_requests_per_serving_actor(group):
    g, calls, run = group
    g.engine_lost(1, launched_at=1.0)
    assert g.serving == [0, 2] and g.restarts == 1
    g.launch(allowed=100, queued_elsewhere=3)
    assert [a for a, _, _ in calls] == [0, 2] * 4  # 2 slots x 2 requests per slot x 2 serving actors
    assert len(g.pending) == 8 and g.queued_tasks() == 16


def test_requests_that_only_score_leave_room_for_more_up_to_the_actor_total(group):
    """A request that delivered groups generates no more (the rest of it scores): it no longer
    counts against the slots' cap, only against `RequestLimits.held` (the actor's threads)."""
    from rlcore.engine.slots import RequestLimits

    g, calls, run = group
    g.launch(allowed=1000, queued_elsewhere=0)
    assert len(g.pending) == 12  # 2 slots x 2 requests per slot x 3 actors
    for q in g.pending.values():
        q.arrived.add(0)  # each delivered one of its two groups
    g.launch(allowed=1000, queued_elsewhere=0)
    assert len(g.pending) == 24  # 12 more that generate
    assert g.queued_tasks() == 12 * 1 + 12 * 2 and run.acct.in_flight == 24 * 2 * 4
    for _ in range(10):  # while every request delivers a group, more go out up to the actors' total
        for q in g.pending.values():
            q.arrived.add(0)
        g.launch(allowed=1000, queued_elsewhere=0)
    assert len(g.pending) == RequestLimits(2).held * 3


def test_an_overdue_request_is_cancelled_and_counted_failed(group, monkeypatch):
    import actors.rollout_group as mod

    g, calls, run = group
    g.launch(allowed=2, queued_elsewhere=0)
    (req,) = g.pending.values()
    req.launched_at -= g.timeout_s + 1
    cancelled = []
    monkeypatch.setattr(mod.ray, "cancel", lambda ref, force: cancelled.append(ref))
    g.expire()
    assert len(cancelled) == 1 and not g.pending
    assert run.acct.failed == 8 and run.acct.in_flight == 0


def test_groups_scoring_long_after_their_request_delivered_stop_holding_the_budget(group):
    """A straggler (`rlcore.batch.stragglers`: still scoring well after its request's first group came)
    keeps its request's place at the actor but not its place in the staleness budget, so the
    next groups are launched; requests whose rest arrives in time keep counting."""
    import time

    g, calls, run = group
    g.launch(allowed=6, queued_elsewhere=0)  # 3 requests x 2 tasks: the bound
    assert len(calls) == 3 and g.queued_tasks() == 6
    for _ in range(8):
        g.lags.note(0.01)  # cheap rewards so far: groups of a request arrive together
    late, fresh, silent = list(g.pending.values())
    late.arrived.add(0)
    late.first_at = time.perf_counter() - 5.0  # its other group has scored for 5 s
    fresh.arrived.add(0)
    fresh.first_at = time.perf_counter()  # its other group is a few ms behind
    assert g.queued_tasks() == 0 + 1 + 2 and g.overdue_groups == 1
    g.launch(allowed=6, queued_elsewhere=0)
    assert [n for _, n, _ in calls[3:]] == [2, 1]  # the straggler's place went to new requests
    assert g.overdue_groups == 1  # counted once, however often it is looked at


def test_nothing_is_overdue_before_enough_lags_are_known_nor_when_rewards_are_slow_by_nature():
    from rlcore.batch.stragglers import FACTOR, MIN_LAGS, MIN_S, ScoringLags

    lags = ScoringLags()
    for _ in range(MIN_LAGS - 1):
        lags.note(0.0)
    for _ in range(50):
        lags.note(2.0, scored=False)  # groups that failed at a deadline tell nothing of scoring
    assert lags.overdue_after_s() is None
    lags.note(0.0)
    assert lags.overdue_after_s() == MIN_S
    for _ in range(4 * MIN_LAGS):
        lags.note(3.0)  # a reward that takes seconds on most groups: the threshold follows it
    assert lags.overdue_after_s() == FACTOR * 3.0
