import pytest

from rlcore.batch.buffer import Accounting, RolloutBuffer
from rlcore.types import Group, Sample, Task


def group(version: int, n: int = 2, failed: int = 0, rewards=None) -> Group:
    rewards = rewards or [float(i) for i in range(n)]
    samples = [
        Sample([1], [2, 3], [-0.1, -0.2], [version, version + 1], [1, 1], reward=rewards[i], failed=i < failed)
        for i in range(n)
    ]
    return Group(task=Task(id="t", messages=[]), samples=samples)


def make(max_off: int, capacity: int = 100):
    acct = Accounting()
    return RolloutBuffer(max_off, capacity, acct), acct


def test_min_version_is_oldest_policy_token():
    g = group(3)
    assert g.min_version == 3
    g.samples[0].versions = [1, 5]
    assert g.min_version == 1


def test_stale_groups_dropped_and_counted():
    buf, acct = make(max_off=1)
    buf.launched(6)
    for v in (0, 1, 2):
        buf.add(group(v))
    batch = buf.pop_batch(version=2, num_groups=2)
    assert [g.min_version for g in batch] == [1, 2]
    assert acct.dropped_stale == 2 and acct.trained == 4 and acct.in_flight == 0
    acct.check()


def test_synchronous_bound_keeps_only_current_version():
    buf, acct = make(max_off=0)
    buf.launched(4)
    buf.add(group(0))
    buf.add(group(1))
    assert buf.pop_batch(version=1, num_groups=1)[0].min_version == 1
    assert acct.dropped_stale == 2
    acct.check()


def test_not_enough_groups_returns_none_and_keeps_them():
    buf, acct = make(max_off=2)
    buf.launched(2)
    buf.add(group(0))
    assert buf.pop_batch(version=0, num_groups=2) is None
    assert len(buf) == 1 and acct.in_flight == 2
    acct.check()


def test_failed_samples_are_counted_not_buffered():
    buf, acct = make(max_off=1)
    buf.launched(4)
    buf.add(group(0, n=2, failed=1))
    buf.add(group(0, n=2, failed=2))
    assert len(buf) == 1 and len(buf.pop_batch(0, 1)[0].samples) == 1
    assert acct.failed == 3
    acct.check()


def test_request_failure_counted():
    buf, acct = make(max_off=1)
    buf.launched(8)
    buf.fail(8)
    assert acct.failed == 8 and acct.in_flight == 0
    acct.check()


def test_filter_counts_zero_advantage_groups():
    buf, acct = make(max_off=1)
    buf.launched(4)
    buf.add(group(0, rewards=[1.0, 1.0]))
    buf.add(group(0, rewards=[0.0, 1.0]))
    batch = buf.pop_batch(0, 1, keep=lambda g: len(set(g.rewards)) > 1)
    assert batch[0].rewards == [0.0, 1.0] and acct.filtered == 2
    acct.check()


def test_capacity_is_enforced():
    buf, _ = make(max_off=1, capacity=1)
    buf.launched(4)
    buf.add(group(0))
    with pytest.raises(OverflowError):
        buf.add(group(0))


def test_broken_accounting_detected():
    acct = Accounting(generated=3, trained=1)
    with pytest.raises(AssertionError):
        acct.check()


def test_a_batch_put_back_is_popped_first_and_counted_in_flight_again():
    """A batch whose train step died (the trainer healed from the engines' weights) is trained
    again: back at the front, and no longer counted trained."""
    buf, acct = make(1)
    groups = [group(0) for _ in range(4)]
    for g in groups:
        buf.launched(2)
        buf.add(g)
    batch = buf.pop_batch(0, 2)
    assert acct.trained == 4 and acct.in_flight == 4
    buf.put_back(batch)
    assert acct.trained == 0 and acct.in_flight == 8
    acct.check()
    assert buf.pop_batch(0, 2) == batch and buf.pop_batch(0, 2) == groups[2:]


def test_withdrawn_samples_leave_the_accounting_as_if_never_requested():
    buf, acct = make(1)
    buf.launched(8)
    buf.withdraw(8)
    assert acct.generated == 0 and acct.in_flight == 0
    acct.check()


def test_the_staleness_rule_is_one_module_that_the_buffer_and_the_launch_rule_share():
    from rlcore.batch import staleness

    # trained at version 5, a group from version 3 is 2 steps behind
    assert staleness.is_stale(5, 3, max_off_policy_steps=1)
    assert not staleness.is_stale(5, 4, max_off_policy_steps=1)
    assert not staleness.is_stale(5, 5, max_off_policy_steps=0)
    assert staleness.most_groups_in_flight(1, 4) == staleness.groups_allowed_in_flight(3, 3, 1, 4) == 8
    assert staleness.groups_allowed_in_flight(3, 5, 1, 4) == 0  # never negative
