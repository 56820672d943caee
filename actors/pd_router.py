"""The prefill/decode router (`rollout.pd.*`), inside each decode actor: every generate call of
its episodes prefills on a prefill engine, then decodes on this actor's engine from the handle.

The handle travels through Ray's object store: the prefill actor's call returns it as an object
that this actor fetches from the prefill actor's node (never through the driver). The router
picks the prefill engine with the fewest of its own calls in flight among those the driver says
serve (`set_serving`: a dead or frozen one leaves at once, a restarted one comes back once it
holds the weights) and that have not failed a call in the last `rollout.pd.retry_after_s`. A call
that fails because its engine died, froze past `rollout.pd.prefill_timeout_s` or was restarted
without the weights yet (`PrefillNotServing`) goes to another prefill engine; any other error is
the request's own and fails it.

Versions: a prefill computed on weights newer than this engine's (mid-sync: both pools receive
every sync in one group, but land it a moment apart) waits until this engine holds them, so no
sample decodes backwards; its first token carries the prefill's version, so the sample's
staleness counts from its prefill.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter

import ray

from rlcore.config.pd import PDConfig

log = logging.getLogger("rlcore")

POLL_S = 0.01
"""How often a decode call waiting for its engine's weights (or for a prefill engine) looks again."""


class _NotFound(Exception):
    """A prefill actor's name is not registered (yet)."""


class PrefillNotServing(RuntimeError):
    """A prefill actor Ray restarted has no weights yet (it rejoins at a step boundary)."""


class PrefillRouter:
    """`engine`: this actor's decode engine; `actors[j]`: the Ray actor name of prefill actor j
    (its handle is looked up on first use), named in logs by `names[j]`. Every other attribute is
    the engine's (`score`, `policy_version`, ...)."""

    def __init__(self, engine, actors: list[str], names: list[str], pd: PDConfig, deadline_s: float,
                 version_wait_s: float):
        self.engine, self.actors, self.names, self.pd = engine, actors, names, pd
        self.handles: list = [None] * len(actors)
        self.deadline_s, self.version_wait_s = deadline_s, version_wait_s
        self._lock = threading.Lock()
        self.in_flight = [0] * len(actors)
        self.down_until = [0.0] * len(actors)
        self.serving = set(range(len(actors)))
        self.failovers: Counter = Counter()
        """Prefill calls sent elsewhere, by the name of the prefill actor that failed them."""

    def set_serving(self, serving: list[int]) -> None:
        """The prefill engines the driver counts as serving (positions in `handles`)."""
        with self._lock:
            self.serving = set(serving)

    def _pick(self) -> int | None:
        now = time.monotonic()
        with self._lock:
            up = [j for j in sorted(self.serving) if self.down_until[j] <= now]
            if not up:
                return None
            j = min(up, key=lambda k: self.in_flight[k])
            self.in_flight[j] += 1
            return j

    def prefill(self, prompts: list[list[int]], params, images=None):
        """The handle (`rlcore.engine.base.Prefilled`) of a prefill engine for `prompts`; raises
        TimeoutError when none answered within the generate deadline."""
        give_up = time.monotonic() + self.deadline_s
        while time.monotonic() < give_up:
            j = self._pick()
            if j is None:
                time.sleep(POLL_S * 10)
                continue
            ref, why = None, "not found"  # no such actor (yet): Ray is still creating it
            try:
                if self.handles[j] is None:  # a named actor keeps its name through restarts
                    try:
                        self.handles[j] = ray.get_actor(self.actors[j])
                    except ValueError:
                        raise _NotFound from None
                ref = self.handles[j].prefill.remote(prompts, params, images)
                return ray.get(ref, timeout=self.pd.prefill_timeout_s)
            except _NotFound:
                pass
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError,
                    ray.exceptions.ActorUnavailableError) as exc:
                why = "timed out" if isinstance(exc, ray.exceptions.GetTimeoutError) else "died"
                if why == "timed out" and ref is not None:
                    ray.cancel(ref, force=False)
            except ray.exceptions.RayTaskError as exc:
                if not isinstance(exc.as_instanceof_cause(), PrefillNotServing):
                    raise
                why = "not serving yet (restarted)"
            finally:
                with self._lock:
                    self.in_flight[j] -= 1
            with self._lock:
                self.down_until[j] = time.monotonic() + self.pd.retry_after_s
                self.failovers[self.names[j]] += 1
            log.warning("prefill on %s %s: the call goes to another prefill engine (%d failed over so far)",
                        self.names[j], why, sum(self.failovers.values()))
        raise TimeoutError(f"no prefill engine answered within {self.deadline_s:g}s "
                           f"(rollout.generate_timeout_s); failed over: {dict(self.failovers)}")

    def generate(self, prompts: list[list[int]], params, images=None):
        """Prefill on a prefill engine, then decode here from its handle."""
        if not prompts:
            return []
        handle = self.prefill(prompts, params, images)
        waited = time.monotonic() + self.version_wait_s
        while self.engine.policy_version < handle.version:  # this engine's part of the sync still lands
            if time.monotonic() > waited:
                raise TimeoutError(f"prefill at version {handle.version}, but this decode engine still holds "
                                   f"{self.engine.policy_version} after rollout.weight_sync_timeout_s")
            time.sleep(POLL_S)
        return self.engine.generate(prompts, params, images, prefilled=handle)

    def __getattr__(self, name: str):
        return getattr(self.engine, name)
