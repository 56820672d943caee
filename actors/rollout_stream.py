"""A training generate request, read group by group as its stream delivers them.

`RolloutWorker.generate_stream` runs with `num_returns="streaming"`: two objects per group, in
the order the groups are whole (a reward that hangs delays its own group only): the group's
metadata, which the driver reads, then its token data, whose ref the driver keeps for the
trainer ranks. The driver owns every object of the stream, so token data outlives the actor.

The driver never fetches token data: `ray.wait` on a stream fetches the next object, so a stream
is waited on (`Stream.waitable`) only while its next object is metadata; the token data that
follows is looked for with `fetch_local=False`. A failed task ends its stream with one object
holding the error, possibly in a token-data position (the actor died between a group's two
objects): a token-data ref is trusted only while the stream goes on, or once the task is known
to have completed (`ObjectRefGenerator.completed`).
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

import ray

from rlcore.types import GroupMeta, Task

READ_TIMEOUT_S = 10.0
"""Deadline of a read of metadata the stream said was ready, and of the task's completion
once its stream has ended (both are there already: the wait is a bound, not a pause)."""
DATA_WAIT_S = 1.0
"""How long `read` waits for a group's token-data ref after its metadata (the actor sends them
back to back); past it the stream is read again on the driver's next round."""


def launch_stream(actor, tasks: list[Task], group_size: int, seed: int | None):
    """Start a training generate request on `actor`: its stream (`ray.ObjectRefGenerator`)."""
    return actor.generate_stream.options(num_returns="streaming").remote(tasks, group_size, "train", seed)


@dataclass
class Ended:
    """How a stream ended: `error` None when its task completed, else the error it ended with."""

    error: ray.exceptions.RayError | None = None


@dataclass
class Stream:
    """One request in flight: where it went, its tasks, and which of their groups arrived."""

    actor: int
    tasks: list[Task]
    group_size: int
    launched_at: float
    gen: object
    """Its `ray.ObjectRefGenerator`."""
    indices: list[int] = field(default_factory=list)
    """Train-stream index of each task (data order; put back on resume)."""
    seq: int = -1
    arrived: set[int] = field(default_factory=set)
    """Positions (in `tasks`) of the groups delivered."""
    held: tuple | None = None
    """Metadata read whose token-data ref has not come yet."""
    all_failed: bool = True
    """Whether every sample delivered so far failed (the failure log's streak)."""
    reasons: Counter = field(default_factory=Counter)
    """Its failed samples by reason, so far (the failure log's streak)."""
    first_at: float | None = None
    """When its first group arrived (`time.perf_counter`): from then on the rest only scores."""
    overdue: bool = False
    """Whether its groups not delivered passed the overdue threshold (`rlcore.batch.stragglers`)."""

    @property
    def samples(self) -> int:
        return len(self.tasks) * self.group_size

    @property
    def samples_left(self) -> int:
        """Samples of the groups not delivered: counted failed (or withdrawn) if it ends now."""
        return (len(self.tasks) - len(self.arrived)) * self.group_size

    def left(self) -> list[tuple[int, Task]]:
        """(stream index, task) of every group not delivered."""
        return [(self.indices[p], t) for p, t in enumerate(self.tasks) if p not in self.arrived]

    @property
    def waitable(self) -> bool:
        """Whether its next object is metadata (waiting on it fetches nothing else)."""
        return self.held is None

    def read(self, data_wait_s: float = DATA_WAIT_S) -> tuple[list[GroupMeta], Ended | None]:
        """Never blocks longer than `data_wait_s` (plus bounded reads of what is there): the
        groups that arrived since the last read, and how the stream ended (None: not yet)."""
        out: list[GroupMeta] = []
        gen = self.gen
        while True:
            if gen.is_finished():
                return out, self._end()
            wait_s = 0.0 if self.held is None else data_wait_s
            if not ray.wait([gen], num_returns=1, timeout=wait_s, fetch_local=self.held is None)[0]:
                return out, None
            try:
                ref = next(gen)
            except StopIteration:
                return out, self._end()
            if self.held is None:
                try:
                    self.held = ray.get(ref, timeout=READ_TIMEOUT_S)
                except ray.exceptions.RayError as exc:
                    return out, Ended(exc)
                continue
            # a token-data ref is the error of a failed task only as the stream's last object
            if gen.is_finished():
                ended = self._end()
                if ended.error is not None:
                    self.held = None
                    return out, ended
            (position, metas, stats), self.held = self.held, None
            if position in self.arrived or not 0 <= position < len(self.tasks):
                continue  # the actor sends each group once: a stray one is not counted twice
            self.arrived.add(position)
            if self.first_at is None:
                self.first_at = time.perf_counter()
            self.all_failed = self.all_failed and all(m.failed for m in metas)
            out.append(
                GroupMeta(
                    task=self.tasks[position],
                    samples=metas,
                    data=ref,
                    request_id=self.seq,
                    stream_index=self.indices[position],
                    env_stats=stats,
                )
            )

    def _end(self) -> Ended:
        try:
            ray.get(self.gen.completed(), timeout=READ_TIMEOUT_S)
        except ray.exceptions.RayError as exc:
            return Ended(exc)
        return Ended()
