"""The prefill/decode router (`rollout.pd.*`), inside each decode actor: every generate call of
its episodes prefills on a prefill engine, then decodes on this actor's engine from the handle.

The handle travels through Ray's object store: the prefill actor's call returns it as an object
that this actor fetches from the prefill actor's node (never through the driver). The router
picks the prefill engine with the fewest of its own calls in flight among those the driver says
serve (`set_serving`: a dead or frozen one leaves at once, a restarted one comes back once it
holds the weights) and that have not failed a call in the last `rollout.pd.retry_after_s`. A call
that fails because its engine died, froze past `rollout.pd.prefill_timeout_s` (or left the serving
set: the driver's stall watch named it frozen, `_answer`) or was restarted without the weights
yet (`PrefillNotServing`) goes to another prefill engine; any other error is the request's own
and fails it.

Versions (a sample's cache and the weights that decode it are of one version). A handle carries
the version its prefill ran with (`Prefilled.version`), and this engine decodes a handle only on
that version: the prefill call asks for at least this engine's version (a prefill engine still
behind answers `PrefillBehind` at once, computing nothing, and is asked again: its part of the
sync is landing), a handle newer than this engine waits here for this engine's part of the sync
(the prefill's work is kept: cheaper than computing it again), and one older (this engine moved
on during the prefill) or refused by the engine (`StalePrefill`: a sync landed before the cache
met the weights) is prefilled again. Holding the newer handle instead of re-prefilling keeps
the prefill pool's work; re-prefilling the older one is the only way forward (this engine cannot
go back), and both happen only inside a sync's window. The barrier: a handle is decoded only
once the driver released its version (`release`: every engine of both pools the sync reached
holds it), so neither pool serves version v+1 with the other still on v. A sample's first tokens
thus carry one version, from which its staleness counts.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter

import ray

from rlcore.config.pd import PDConfig
from rlcore.engine.base import StalePrefill

log = logging.getLogger("rlcore")

POLL_S = 0.01
"""How often a decode call waiting for its engine's weights (or for a prefill engine) looks again."""


ANSWER_POLL_S = 0.5
"""How often a prefill call in flight looks whether its engine still serves (`_answer`)."""


class _NotFound(Exception):
    """A prefill actor's name is not registered (yet)."""


class PrefillNotServing(RuntimeError):
    """A prefill actor Ray restarted has no weights yet (it rejoins at a step boundary)."""


class PrefillBehind(RuntimeError):
    """A prefill engine holds an older version than the decode engine asking (its part of the
    sync has not landed yet): nothing was computed; ask again."""


class PrefillRouter:
    """`engine`: this actor's decode engine; `actors[j]`: the Ray actor name of prefill actor j
    (its handle is looked up on first use), named in logs by `names[j]`. Every other attribute is
    the engine's (`score`, `policy_version`, ...)."""

    def __init__(
        self, engine, actors: list[str], names: list[str], pd: PDConfig, deadline_s: float, version_wait_s: float
    ):
        self.engine, self.actors, self.names, self.pd = engine, actors, names, pd
        self.handles: list = [None] * len(actors)
        self.deadline_s, self.version_wait_s = deadline_s, version_wait_s
        self._lock = threading.Lock()
        self.in_flight = [0] * len(actors)
        self.down_until = [0.0] * len(actors)
        self.serving = set(range(len(actors)))
        self.failovers: Counter = Counter()
        """Prefill calls sent elsewhere, by the name of the prefill actor that failed them."""
        self.released = 0
        """The newest version the driver said every engine of the sync holds (`release`)."""
        self.stats: Counter = Counter()
        """`decoded` handles, by the version rule: `reprefilled` (older than this engine, or
        refused by it), `held` (newer than this engine or not released yet: waited), `behind`
        (a prefill engine asked again while its sync lands)."""

    def release(self, version: int) -> None:
        """Every engine of both pools that the sync reached holds `version`: handles of it decode."""
        with self._lock:
            self.released = max(self.released, version)

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

    def prefill(self, prompts: list[list[int]], params, images=None, at_least: int = 0):
        """The handle (`rlcore.engine.base.Prefilled`) of a prefill engine for `prompts`, of version
        `at_least` or newer; raises TimeoutError when none answered within the generate deadline."""
        give_up = time.monotonic() + self.deadline_s
        while time.monotonic() < give_up:
            j = self._pick()
            if j is None:
                time.sleep(POLL_S * 10)
                continue
            ref, why, behind = None, "not found", False  # not found: Ray is still creating it
            try:
                if self.handles[j] is None:  # a named actor keeps its name through restarts
                    try:
                        self.handles[j] = ray.get_actor(self.actors[j])
                    except ValueError:
                        raise _NotFound from None
                ref = self.handles[j].prefill.remote(prompts, params, images, at_least)
                return self._answer(j, ref)
            except _NotFound:
                pass
            except (
                ray.exceptions.RayActorError,
                ray.exceptions.GetTimeoutError,
                ray.exceptions.ActorUnavailableError,
            ) as exc:
                why = "died"
                if isinstance(exc, ray.exceptions.GetTimeoutError):
                    why = "left the serving set (frozen or dead)" if j not in self.serving else "timed out"
                if why == "timed out" and ref is not None:
                    ray.cancel(ref, force=False)
            except ray.exceptions.RayTaskError as exc:
                cause = exc.as_instanceof_cause()
                if isinstance(cause, PrefillBehind):  # mid-sync: not down, asked again in a moment
                    behind = True
                elif not isinstance(cause, PrefillNotServing):
                    raise
                why = "not serving yet (restarted)"
            finally:
                with self._lock:
                    self.in_flight[j] -= 1
            if behind:  # another prefill engine first, if one serves; this one again in a moment
                with self._lock:
                    self.stats["behind"] += 1
                    self.down_until[j] = time.monotonic() + POLL_S
                time.sleep(POLL_S)
                continue
            with self._lock:
                self.down_until[j] = time.monotonic() + self.pd.retry_after_s
                self.failovers[self.names[j]] += 1
            log.warning(
                "prefill on %s %s: the call goes to another prefill engine (%d failed over so far)",
                self.names[j],
                why,
                sum(self.failovers.values()),
            )
        raise TimeoutError(
            f"no prefill engine answered within {self.deadline_s:g}s "
            f"(rollout.generate_timeout_s); failed over: {dict(self.failovers)}"
        )

    def _answer(self, j: int, ref):
        """Prefill engine `j`'s handle; GetTimeoutError past `rollout.pd.prefill_timeout_s`, or as
        soon as the driver takes `j` out of the serving set (a frozen engine's calls never answer:
        they go elsewhere at once, not at the prefill deadline)."""
        give_up = time.monotonic() + self.pd.prefill_timeout_s
        while not ray.wait([ref], timeout=min(ANSWER_POLL_S, max(0.0, give_up - time.monotonic())))[0]:
            if j not in self.serving or time.monotonic() >= give_up:
                raise ray.exceptions.GetTimeoutError(f"prefill on actor {self.names[j]}")
        return ray.get(ref, timeout=0)

    def generate(self, prompts: list[list[int]], params, images=None):
        """Prefill on a prefill engine, then decode here from its handle, both on one version
        (module docstring); TimeoutError when no such pair came within the sync deadline."""
        if not prompts:
            return []
        give_up = time.monotonic() + self.version_wait_s
        while True:
            handle = self.prefill(prompts, params, images, at_least=self.engine.policy_version)
            if self._hold(handle.version, give_up):
                try:
                    out = self.engine.generate(prompts, params, images, prefilled=handle)
                    with self._lock:
                        self.stats["decoded"] += 1
                    return out
                except StalePrefill:
                    pass
            self._count(
                "reprefilled",
                f"a prefill at version {handle.version} met this decode engine at "
                f"{self.engine.policy_version}: prefilled again",
            )
            if time.monotonic() > give_up:
                raise TimeoutError(
                    f"no prefill of this decode engine's version (it holds {self.engine.policy_version}, "
                    f"released {self.released}) within rollout.weight_sync_timeout_s"
                )

    def _hold(self, version: int, give_up: float) -> bool:
        """Wait while this engine is older than `version` or the driver has not released it; then
        whether this engine holds `version` (False: it holds a newer one, prefill again)."""
        held = False
        while self.engine.policy_version < version or self.released < version:
            if time.monotonic() > give_up:
                raise TimeoutError(
                    f"prefill at version {version}, but this decode engine holds "
                    f"{self.engine.policy_version} (released {self.released}) after "
                    "rollout.weight_sync_timeout_s"
                )
            held = True
            time.sleep(POLL_S)
        if held:
            self._count("held", f"a prefill at version {version} waited for both pools to hold it")
        return self.engine.policy_version == version

    def _count(self, what: str, line: str) -> None:
        """Count a version-rule event; its first one is said in the actor's log (logs/rollout-INDEX.log)."""
        with self._lock:
            self.stats[what] += 1
            first = self.stats[what] == 1
        if first:
            print(f"decode router: first {what}: {line}", flush=True)

    def __getattr__(self, name: str):
        return getattr(self.engine, name)
