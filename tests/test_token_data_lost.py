"""A step whose groups' token data was lost with the node that made it (Ray keeps an engine's
objects in its node's store; a node's death takes the only copy, and the generate call is not run
again): no trainer rank trains (they agree first, `TrainerCore.every_rank`), the trainer group
names the lost groups (`TokenDataLost`), and the driver counts them failed under one reason and
puts the rest of the batch back for the next step. Before, the rank that could not read raised,
the others waited in the step's collectives, and the job exited 1 (4 of 6 runs of
benchmarks/cluster_chaos.py). Groups' refs here are plain objects with `binary()`, as Ray's are."""

from __future__ import annotations

import pytest

from actors.driver import Driver, StepState
from actors.trainer_group import TokenDataLost, TrainerGroup
from rlcore.batch.buffer import Accounting, RolloutBuffer
from rlcore.batch.meta import group_meta
from rlcore.batch.step import RankWork
from rlcore.report.failures import FailureLog
from rlcore.types import Group, Sample, Task


class Ref:
    def __init__(self, name: str):
        self.name = name

    def binary(self) -> bytes:
        return self.name.encode()


def groups(n: int) -> list:
    out = []
    for i in range(n):
        samples = [
            Sample(
                prompt_ids=[1],
                completion_ids=[2, 3],
                logprobs=[-1.0, -1.0],
                versions=[0, 0],
                loss_mask=[1, 1],
                reward=float(k),
            )
            for k in range(2)
        ]
        out.append(group_meta(Group(task=Task(id=f"t{i}", messages=[]), samples=samples), data=Ref(f"g{i}")))
    return out


def test_the_trainer_group_names_the_groups_no_rank_could_read():
    batch = groups(4)
    group = TrainerGroup.__new__(TrainerGroup)
    group._pushed = None
    group._works = [
        RankWork([batch[0].data, batch[2].data], [], [], []),
        RankWork([batch[1].data, batch[3].data], [], [], []),
    ]
    group._get = lambda refs, what: [{"token_data_lost": []}, {"token_data_lost": [1]}]  # rank 1's second group
    with pytest.raises(TokenDataLost) as lost:
        group.finish_step(["r0", "r1"], 3)
    assert lost.value.refs == [batch[3].data]
    group._get = lambda refs, what: [{"version": 3, "loss": 0.1}, {"version": 3, "loss": 0.1}]
    assert group.finish_step(["r0", "r1"], 3).version == 3  # a step every rank read trains as before


def test_the_driver_counts_the_lost_groups_failed_and_puts_the_rest_back_in_order():
    acct = Accounting()
    buffer = RolloutBuffer(1, 100, acct)
    batch = groups(4)
    buffer.launched(4 * 2)
    for g in batch:
        buffer.add(g)
    popped = buffer.pop_batch(0, 4)
    assert popped == batch and acct.trained == 8
    woken = []
    driver = Driver.__new__(Driver)
    driver.buffer, driver.failures = buffer, FailureLog(0)
    driver.weights = type("W", (), {"after_train": lambda self: woken.append(True) or {}})()
    driver.drop_lost(StepState(5, popped, 0), [Ref("g1"), Ref("g3")])
    acct.check()  # generated == trained + dropped + failed + in flight + filtered
    assert (acct.trained, acct.failed, acct.in_flight) == (0, 4, 4)
    assert woken == [True]  # engines that slept for the step wake
    assert buffer.pop_batch(0, 2) == [batch[0], batch[2]]  # the rest, first in line, in order
    reasons = driver.failures.step_counts
    assert reasons == {"engine: token data lost with the node that made it": 4}, reasons
