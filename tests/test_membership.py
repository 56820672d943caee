"""Which rollout actors serve (actors.membership): a death is news once, calls of an earlier life
are ignored, an actor joins only once ready, and one that died again while joining stays out."""

import time

from actors.membership import Members


def test_a_death_leaves_once_and_a_ready_restart_joins_in_slot_order():
    m = Members([object(), object(), object()], restart_timeout_s=60)
    assert m.lost(1, launched_at=5.0) and m.serving == [0, 2] and m.reform
    assert not m.lost(1, launched_at=6.0)  # its other requests in flight fail too: not news
    m.admit([1])  # not ready yet: stays out
    assert m.serving == [0, 2] and 1 in m.restarting
    m.restarting[1].ready = True
    m.admit([1])
    assert m.serving == [0, 1, 2] and not m.restarting
    assert not m.lost(1, launched_at=6.0)  # a call of its earlier life failing late
    assert m.lost(1, launched_at=m.joined_at[1] + 1)  # a new death


def test_dying_again_while_joining_restarts_the_watch():
    m = Members([object(), object()], restart_timeout_s=60)
    m.lost(0, launched_at=1.0)
    m.restarting[0].ready = True
    left_at = m.restarting[0].left_at
    assert m.lost(0, launched_at=float("inf"))  # the admission sync found it dead: a new death
    assert not m.lost(0, launched_at=float("inf"))  # still restarting: not news
    assert not m.restarting[0].ready and m.restarting[0].left_at == left_at  # same deadline
    assert m.admit([0]) == [] and m.serving == [1]


def test_a_stall_is_counted_as_a_stall_and_becomes_a_death_only_if_the_actor_dies():
    m = Members([object(), object()], restart_timeout_s=60)
    assert m.lost(0, launched_at=float("inf"), stalled=True) and m.serving == [1]
    assert (m.deaths, m.stalls) == (0, 1) and m.back_from_stall(0)
    m.restarting[0].ready = True  # it answered again: it rejoins as a stall, not a restart
    assert m.back_from_stall(0) and m.admit([0]) == [0] and (m.deaths, m.stalls) == (0, 1)
    assert m.lost(1, launched_at=float("inf"), stalled=True)
    assert m.lost(1, launched_at=float("inf"))  # then Ray reports it dead: news, and a death
    assert (m.deaths, m.stalls) == (1, 2) and not m.back_from_stall(1)
    assert not m.lost(1, launched_at=float("inf"))  # restarting: not news again
    assert m.deaths == 1


def test_a_call_of_the_life_that_died_failing_after_the_restart_is_ready_is_no_second_death():
    """A driver held up (a weight sync that waited out its timeout) read the failures of the
    requests in flight on the killed actor only once Ray had restarted it: each was counted a
    second death (two rollout_died events, rollout_restarts 2 for one kill)."""
    m = Members([object(), object()], restart_timeout_s=60)
    launched = time.perf_counter()
    assert m.lost(1, launched_at=float("inf"))  # the weight sync saw it die
    m.restarting[1].ready = True  # its restart answered ready() before the driver read the requests
    assert not m.lost(1, launched_at=launched)  # a generate request launched before the death
    assert m.restarting[1].ready and m.serving == [0]
    assert m.lost(1, launched_at=time.perf_counter())  # a call of its new life: a new death


def test_capacity_that_is_gone_is_said_at_once_and_named_by_the_restart_deadline(caplog):
    """A restarting actor whose bundle no alive node can host (its node lost, no replacement):
    one line at once naming why, the wait goes on to its deadline, then the run stops with that
    cause (it used to wait in silence, then say only 'not back')."""
    import logging

    import pytest

    from actors.remote import RunError

    gone = "no alive node has the label rlcore-group=rollout the rollout group asks for"
    m = Members([object(), object()], restart_timeout_s=0.3, capacity=lambda: gone)
    m.lost(0, launched_at=1.0)
    m.restarting[0].retry_at = float("inf")  # no ready() probe here: the actor is nowhere
    with caplog.at_level(logging.WARNING, logger="rlcore"):
        assert m.poll() == []
        assert m.poll() == []
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and gone in lines[0] and "rollout actor(s) 0" in lines[0] and "0s" in lines[0], lines
    time.sleep(0.4)
    with pytest.raises(
        RunError, match="rollout actor 0 could not be restarted: no alive node has the label rlcore-group=rollout"
    ):
        m.poll()
