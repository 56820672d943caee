"""Heartbeats of the serving rollout actors: a frozen engine is seen in seconds, not when Ray
declares its node dead.

A stopped process (SIGSTOP, a hung node) is not dead: its calls neither answer nor fail, and Ray
notices only once the node misses its health checks (a minute on a loaded cluster), while
rlcore's own deadlines (`rollout.generate_timeout_s`, the sync's) are longer still. Each serving
actor is asked `ready()` every `BEAT_S` (a threaded actor answers it between decode steps, while
it generates); one whose question has gone unanswered for `rollout.stall_timeout_s` is named by
`stalled`. Never blocks.
"""

from __future__ import annotations

import time
from typing import Iterable

import ray

from actors.remote import forget

BEAT_S = 2.0
"""How often a serving actor is asked `ready()`."""
WAIT_NOTICE_S = 5.0
"""A wait of the run (a checkpoint's parts, an upload) still open after this long is named in one
line: what it waits for, where, and how long it will wait."""
BEFORE_SYNC_S = 6.0
"""Silence that keeps an engine out of a weight sync (`RolloutGroup.watch` before each one): a
collective with a frozen member blocks its sender until the member answers or Ray declares its
node dead (a minute), so a sync does not start with an engine that missed three heartbeats."""


class StallWatch:
    """`handles`: the rollout actors; `stall_s`: silence that makes one frozen (0: never)."""

    def __init__(self, handles: list, stall_s: float):
        self.handles, self.stall_s = handles, stall_s
        self.beats: dict[int, tuple[ray.ObjectRef, float]] = {}  # actor -> (its question, asked at)
        self.answered: dict[int, float] = {}  # actor -> when its latest answer was first seen (monotonic)
        self._dead: list[tuple[int, float]] = []  # (actor, when its failed question was asked: perf_counter)

    def stalled(self, actors: Iterable[int], stall_s: float | None = None) -> list[tuple[int, float]]:
        """(actor, seconds unanswered) of the actors of `actors` silent for `stall_s` (default:
        the watch's); asks the others again when their answer came and `BEAT_S` has passed."""
        if self.stall_s <= 0:
            return []
        limit = self.stall_s if stall_s is None else min(stall_s, self.stall_s)
        now, out = time.monotonic(), []
        for i in actors:
            beat = self.beats.get(i)
            if beat is None:
                self.beats[i] = (self.handles[i].ready.remote(), now)
                continue
            ref, asked = beat
            if ray.wait([ref], timeout=0)[0]:
                if self.answered.get(i, float("-inf")) <= asked:
                    try:
                        ray.get(ref, timeout=0)
                        self.answered[i] = now
                    except ray.exceptions.RayActorError:  # it died: the death path's business
                        self._dead.append((i, time.perf_counter() - (now - asked)))
                    except ray.exceptions.RayError:
                        pass  # read here, so Ray never prints it
                if now - asked >= BEAT_S:
                    self.beats[i] = (self.handles[i].ready.remote(), now)
            elif now - asked > limit:
                out.append((i, now - asked))
        return out

    def dead(self) -> list[tuple[int, float]]:
        """(actor, perf_counter when the question was asked) of the questions that failed because
        their actor died, since the last call (an actor without a stream of requests, a prefill
        engine, learns of its death here)."""
        out, self._dead = self._dead, []
        return out

    def answering(self, actor: int, within_s: float = 3 * BEAT_S) -> bool:
        """Whether `actor` answered a question seen within the last `within_s` seconds (alive and
        not frozen: no need to probe it again)."""
        return time.monotonic() - self.answered.get(actor, float("-inf")) <= within_s

    def drop(self, actor: int) -> None:
        """`actor` left the serving set: its question is read whenever it comes (quietly)."""
        beat = self.beats.pop(actor, None)
        if beat is not None:
            forget([beat[0]])
