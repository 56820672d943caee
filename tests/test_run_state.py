"""The RL run's explicit state (actors.run_state): the round-robin actor cursor skips actors not
serving and resumes where an uninterrupted run would be, and the staleness bound at launch."""

import itertools

from actors.run_state import RunState, groups_allowed_in_flight
from rlcore.batch.buffer import Accounting


def cycle_pick(cursor, serving):
    """The driver's former actor choice: next() of a cycle over all actors until one serves."""
    actor = next(cursor)
    while actor not in serving:
        actor = next(cursor)
    return actor


def test_next_actor_is_the_cycle_over_all_actors_skipping_those_not_serving():
    run, cursor = RunState(Accounting(), feed=None), itertools.cycle(range(3))
    serving_by_call = [[0, 1, 2], [0, 2], [0, 2], [2], [0, 1, 2], [1], [0, 1, 2]]
    picks = [run.next_actor(3, s) for s in serving_by_call]
    assert picks == [cycle_pick(cursor, s) for s in serving_by_call]
    assert picks == [0, 2, 0, 2, 0, 1, 2]


def test_restore_cursor_continues_as_the_request_count_says():
    run = RunState(Accounting(), feed=None, request_seq=7)
    run.restore_cursor(3)
    assert run.next_actor(3, [0, 1, 2]) == 1  # requests 0..6 went to 0,1,2,0,1,2,0
    run.restore_cursor(0)  # no actors configured: no division by zero
    assert run.actor_cursor == 0


def test_groups_allowed_in_flight_is_the_staleness_bound():
    run = RunState(Accounting(), feed=None, version=5, version_base=3)  # 2 steps synced since RL began
    # steps up to version + max_off_policy_steps may have their batches in flight
    assert groups_allowed_in_flight(run, batches_started=2, max_off_policy_steps=1, batch_groups=4) == 8
    assert groups_allowed_in_flight(run, batches_started=3, max_off_policy_steps=1, batch_groups=4) == 4
    assert groups_allowed_in_flight(run, batches_started=3, max_off_policy_steps=0, batch_groups=4) == 0
    assert groups_allowed_in_flight(run, batches_started=9, max_off_policy_steps=0, batch_groups=4) == 0
