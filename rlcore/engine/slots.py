"""Generation slots: at most `n` generate calls of one rollout actor run on its engine at once,
whatever else the actor's requests are doing.

A training request is generation, then scoring (rewards; tools and environment turns in a
multi-turn episode, between its generate calls). The engine's capacity is for the first; a
request that scores, or waits on a slow or hung reward until its deadline, must not keep
another request from generating. So the driver may send an actor more requests than it
generates at once (`actors.rollout_group.REQUESTS_PER_SLOT`), and the actor passes its
environments the engine wrapped here: each `generate` takes a slot for its own duration only.
"""

from __future__ import annotations

import threading
from typing import Any


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
