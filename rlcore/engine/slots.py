"""Generation slots: at most `n` generate calls of one rollout actor run on its engine at once,
whatever else the actor's requests are doing.

A training request is generation, then scoring (rewards; tools and environment turns in a
multi-turn episode, between its generate calls). The engine's capacity is for the first; a
request that scores, or waits on a slow or hung reward until its deadline, must not keep
another request from generating. So the driver may send an actor more requests than it
generates at once (`REQUESTS_PER_SLOT`), and the actor passes its environments the engine
wrapped here: each `generate` takes a slot for its own duration only. `RequestLimits` derives
every such number from `rollout.max_requests_per_actor`, in this one place.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from rlcore.config import RolloutConfig

REQUESTS_PER_SLOT = 2
"""Requests the driver keeps at an actor per generation slot that have delivered no group yet
(generating, or waiting at the actor for a slot): as many again as it generates, so the engine
goes on with the next ones while earlier ones score. The staleness bound still caps them all."""
SCORING_PER_SLOT = 8
"""Requests per generation slot, beyond those, that have delivered groups and only score the
rest (a slow or hung reward until its deadline): they hold an actor thread, not the engine. A
request with a hung reward scores for its whole deadline, so this caps requests per second at
(this x slots) / deadline: at 2, 30% of tasks hanging until 2 s held the CPU run to ~2 a second."""


@dataclass(frozen=True)
class RequestLimits:
    """What `rollout.max_requests_per_actor` decides for one rollout actor, derived here only."""

    slots: int
    """Generate calls running at once on the actor's engine (`GenerationSlots`)."""

    @classmethod
    def of(cls, rollout: RolloutConfig) -> RequestLimits:
        """The limits of the rollout section `rollout`."""
        return cls(rollout.max_requests_per_actor)

    @property
    def undelivered(self) -> int:
        """Requests the driver keeps at the actor that delivered no group yet (generating or waiting)."""
        return REQUESTS_PER_SLOT * self.slots

    @property
    def held(self) -> int:
        """Training requests the driver keeps at the actor in all (the rest of them only score)."""
        return (REQUESTS_PER_SLOT + SCORING_PER_SLOT) * self.slots

    @property
    def actor_concurrency(self) -> int:
        """Threads of the actor: every request it holds + one evaluation call + the weight pull +
        one control call (a weight pull never waits behind requests)."""
        return max(4, self.held + 3)

    def prefill_concurrency(self, decode_actors: int) -> int:
        """Threads of a prefill actor: every decode actor's generation slots at once + control calls."""
        return max(4, decode_actors * self.slots + 3)


class GenerationSlots:
    """`engine` (a `rlcore.engine.base.RolloutEngine`) whose `generate` runs in at most `n`
    threads at once (the others wait for a slot, in no set order); every other attribute is the
    engine's own. Make one per engine and keep it: environments may key state on the object
    they are handed (`verifiers_env` keeps its endpoint per engine)."""

    def __init__(self, engine, n: int):
        self.engine = engine
        self._slots = threading.BoundedSemaphore(max(1, int(n)))

    def generate(self, *args: Any, **kwargs: Any):
        with self._slots:
            return self.engine.generate(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self.engine, name)
