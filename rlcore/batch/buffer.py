"""The rollout buffer: finished groups (their metadata, `GroupMeta`: the token data stays in the
object store) wait here until a batch is full; staleness is enforced and every sample is
accounted for."""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass
from typing import Callable

from rlcore.batch.staleness import is_stale
from rlcore.types import GroupMeta


@dataclass
class Accounting:
    """Sample counts. Invariant: generated == trained + dropped_stale + failed + in_flight
    (+ filtered, when dynamic sampling is on).

    `generated` counts samples requested from the engines; `in_flight` those requested and not
    yet trained, dropped or failed (still generating, waiting for the teacher of on-policy
    distillation, or waiting in the buffer)."""

    generated: int = 0
    trained: int = 0
    dropped_stale: int = 0
    failed: int = 0
    in_flight: int = 0
    filtered: int = 0
    """Samples of groups dropped by dynamic sampling (all rewards equal: zero advantage);
    always 0 unless `algo.filter_zero_adv_groups`, and then part of the identity too."""

    def check(self) -> None:
        total = self.trained + self.dropped_stale + self.failed + self.in_flight + self.filtered
        if self.generated != total:
            raise AssertionError(f"sample accounting broken: {self.as_metrics()}")

    def as_metrics(self) -> dict[str, int]:
        return {f"samples_{k}": v for k, v in asdict(self).items()}


class RolloutBuffer:
    """FIFO of finished groups with a staleness bound.

    A group may be trained at policy version ``v`` (the version the trainer is about to update)
    only if it is not stale there (`rlcore.batch.staleness.is_stale`, against the version of
    the group's oldest policy token). Older groups are dropped and counted.
    """

    def __init__(self, max_off_policy_steps: int, capacity_groups: int, accounting: Accounting):
        self.max_off_policy_steps = max_off_policy_steps
        self.capacity_groups = capacity_groups
        self.acct = accounting
        self._groups: deque[GroupMeta] = deque()

    def __len__(self) -> int:
        return len(self._groups)

    def launched(self, samples: int) -> None:
        self.acct.generated += samples
        self.acct.in_flight += samples

    def withdraw(self, samples: int) -> None:
        """Samples requested but taken back before they came (their tasks go to another engine):
        as if never requested."""
        self.acct.generated -= samples
        self.acct.in_flight -= samples

    def fail(self, samples: int) -> None:
        """Samples that were in flight and will never arrive (failed request, dead actor)."""
        self.acct.in_flight -= samples
        self.acct.failed += samples

    def add(self, group: GroupMeta) -> None:
        """Keep a finished group; its failed samples are counted and removed now."""
        ok = [s for s in group.samples if not s.failed]
        self.fail(len(group.samples) - len(ok))
        if not ok:
            return
        if len(self._groups) >= self.capacity_groups:
            raise OverflowError(
                f"rollout buffer over capacity ({self.capacity_groups} groups): "
                "the driver launched more than the staleness bound allows"
            )
        group.samples = ok
        self._groups.append(group)

    def is_stale(self, group: GroupMeta, version: int) -> bool:
        return is_stale(version, group.min_version, self.max_off_policy_steps)

    def drop_stale(self, version: int) -> int:
        """Drop every group too old to train at `version`; returns the samples dropped."""
        keep, dropped = deque(), 0
        for g in self._groups:
            if self.is_stale(g, version):
                dropped += len(g.samples)
            else:
                keep.append(g)
        self._groups = keep
        self.acct.in_flight -= dropped
        self.acct.dropped_stale += dropped
        return dropped

    def pop_batch(
        self, version: int, num_groups: int, keep: Callable[[GroupMeta], bool] | None = None
    ) -> list[GroupMeta] | None:
        """The oldest `num_groups` groups trainable at `version`, or None if there are not enough
        yet. Popped samples count as trained. Groups for which `keep` is false (dynamic
        sampling) are dropped and counted as filtered."""
        self.drop_stale(version)
        if keep is not None:
            kept: deque[GroupMeta] = deque()
            for g in self._groups:
                if keep(g):
                    kept.append(g)
                else:
                    self.acct.in_flight -= len(g.samples)
                    self.acct.filtered += len(g.samples)
            self._groups = kept
        if len(self._groups) < num_groups:
            return None
        batch = [self._groups.popleft() for _ in range(num_groups)]
        n = sum(len(g.samples) for g in batch)
        self.acct.in_flight -= n
        self.acct.trained += n
        return batch

    def put_back(self, batch: list[GroupMeta]) -> None:
        """A popped batch that was never trained (its trainer died in the step): back at the
        front, in order, and counted in flight again instead of trained."""
        n = sum(len(g.samples) for g in batch)
        self._groups.extendleft(reversed(batch))
        self.acct.trained -= n
        self.acct.in_flight += n

    def lose(self, batch: list[GroupMeta]) -> int:
        """Popped groups that can never be trained (their token data was lost): counted failed
        instead of trained. Returns their samples."""
        n = sum(len(g.samples) for g in batch)
        self.acct.trained -= n
        self.acct.failed += n
        return n

    def clear(self) -> int:
        """Forget every buffered group without counting it (the caller restores the accounting
        of a checkpoint that puts their tasks back); returns the groups dropped."""
        n = len(self._groups)
        self._groups.clear()
        return n

    def snapshot(self) -> list[GroupMeta]:
        """The buffered groups, oldest first (a checkpoint records their tasks)."""
        return list(self._groups)

    def max_staleness(self, batch: list[GroupMeta], version: int) -> int:
        return max(version - g.min_version for g in batch)
