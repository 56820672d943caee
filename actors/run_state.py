"""The RL run's own state, as data: what a checkpoint saves and a resume restores, and what the
components of the driver (`RolloutGroup`, `WeightSync`, `StepHooks`) read and advance. It is one
object passed to each of them explicitly, so a reader finds every writer of a field by its name.

`TaskFeed` is the training data order: the environment's train stream, indexed, plus tasks a
resume put back; each generate request is seeded from its first task's index
(`rollout.request_seeds`), so what a request samples does not depend on which actor or thread
runs it, or on what runs next to it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from rlcore.batch import staleness
from rlcore.batch.buffer import Accounting
from rlcore.batch.seeding import derive_seed
from rlcore.types import Task


class TaskFeed:
    """Indexed training tasks: put-back tasks first (in stream order), then the stream."""

    def __init__(self, env, cfg, start: int = 0):
        self.env, self.cfg = env, cfg
        self.restart(start)
        self.requeued: deque[tuple[int, Task]] = deque()

    def restart(self, start: int) -> None:
        self.next_index = start
        self._stream = self.env.tasks("train", start=start)

    def take(self, n: int) -> tuple[list[int], list[Task]]:
        indices, tasks = [], []
        for _ in range(n):
            if self.requeued:
                i, t = self.requeued.popleft()
            else:
                i, t = self.next_index, next(self._stream)
                self.next_index += 1
            indices.append(i)
            tasks.append(t)
        return indices, tasks

    def seed(self, indices: list[int]) -> int | None:
        """The seed of a request whose first task is `indices[0]` (None: the engine's own RNG)."""
        if not self.cfg.rollout.request_seeds or not indices:
            return None
        return derive_seed(self.cfg.seed, "train", indices[0])

    def put_back(self, items: list[tuple[int, Task]]) -> None:
        """(index, task) taken but never generated: handed out again first, in stream order."""
        self.requeued = deque(sorted([*self.requeued, *items], key=lambda it: it[0]))

    def state(self, unfinished: list[tuple[int, Task]]) -> dict[str, Any]:
        """`unfinished`: tasks taken but not yet trained; they are handed out again on resume."""
        back = sorted([*unfinished, *self.requeued], key=lambda it: it[0])
        return {"next_index": self.next_index, "requeue": back}

    def restore(self, state: dict[str, Any]) -> None:
        self.restart(int(state["next_index"]))
        self.requeued = deque(state["requeue"])


@dataclass
class RunState:
    """Where an RL run stands. Writers: the driver's loop (`step`, `version_base`),
    `WeightSync` (`version`), `RolloutGroup.launch` (`request_seq`, `actor_cursor`, `feed`),
    the buffer (`acct`), and a resume (`StepHooks.setup`, all of them)."""

    acct: Accounting
    """Sample accounting: generated = trained + dropped_stale + failed + in_flight (+ filtered)."""
    feed: TaskFeed
    """The training data order (train stream + put-back tasks)."""
    step: int = 0
    """RL optimizer steps done (a resume starts it at the checkpoint's step)."""
    version: int = 0
    """Policy version the engines serve (the trainer's optimizer steps, synced)."""
    version_base: int = 0
    """Engine version when RL step 0 began (an SFT warm-up or a resume moves it)."""
    request_seq: int = 0
    """Generate requests launched so far."""
    actor_cursor: int = 0
    """Round-robin position of the next request's actor: actor `actor_cursor % num_actors`."""
    restarts_before: dict[str, int] = field(default_factory=dict)
    """`rollout_restarts` / `trainer_restarts` of the run's earlier submissions (a resume restores
    them from its checkpoint): a row counts the run's restarts, this process's added."""
    restarts_logged: dict[str, int] = field(default_factory=dict)
    """Those counters as the latest metrics row logged them (a checkpoint keeps them)."""

    def next_actor(self, num_actors: int, serving: list[int]) -> int:
        """The next serving actor in round-robin order (actors not serving are skipped, and the
        cursor moves past them too). `serving` must not be empty."""
        while True:
            actor = self.actor_cursor % num_actors
            self.actor_cursor += 1
            if actor in serving:
                return actor

    def restore_cursor(self, num_actors: int) -> None:
        """After a resume: the cursor where `request_seq` requests without skips leave it."""
        self.actor_cursor = self.request_seq % max(1, num_actors)


def groups_allowed_in_flight(run: RunState, batches_started: int, max_off_policy_steps: int, batch_groups: int) -> int:
    """Groups that may be generating or buffered now: the staleness rule
    (`rlcore.batch.staleness.groups_allowed_in_flight`) at the run's syncs so far."""
    return staleness.groups_allowed_in_flight(
        run.version - run.version_base, batches_started, max_off_policy_steps, batch_groups
    )
