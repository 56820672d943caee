"""Which rollout actors serve (the member part of `actors.rollout_group.RolloutGroup`, its only
user). An actor that serves is in the weight-sync group, takes generate requests and receives
every sync. One that died leaves at once: the group is re-formed from
those left before the next sync, and nothing waits for the dead one. Ray restarts it; its
constructor (a new process, the model build) runs while the others keep generating and the
driver keeps stepping. Once it answers `ready()`, the driver lets it back in at a step boundary
(`actors.weights.WeightSync.admit_restarted`): the group is re-formed with it, it receives the
current version, and only then does it take requests.

Every check here is non-blocking (`ray.wait(timeout=0)`); a restart has a deadline
(`rollout.generate_timeout_s`), and an actor whose restarts are exhausted stops the run.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

import ray

from actors.remote import RunError
from rlcore.report.events import event

log = logging.getLogger("rlcore")

CAPACITY_BEAT_S = 2.0
"""How often, while an actor is away, the alive nodes are asked whether one can host it."""
PROBE_RETRY_S = 0.5
"""How soon an actor Ray is still restarting is asked `ready()` again."""


@dataclass
class Restarting:
    """An actor that left the group: its pending `ready()` probe and since when it is away."""

    left_at: float
    lost_at: float = 0.0
    """When its latest death was counted: a call launched before then failed with that death."""
    probe: ray.ObjectRef | None = None
    retry_at: float = 0.0
    ready: bool = False
    stalled: bool = False
    """It left because it stopped answering, not because Ray reported it dead; it stays a stall
    (not a restart) unless Ray reports it dead or restarting before it answers again."""


class Members:
    """`capacity()`: why no alive node can host a restarting actor's bundle (a node lost with
    no replacement), or None; asked every `CAPACITY_BEAT_S` while one is away, said once at once."""

    def __init__(self, actors: list, restart_timeout_s: float, capacity: Callable[[], str | None] = lambda: None):
        self.actors = actors
        self.capacity = capacity
        self.gone: str | None = None
        self._capacity_at = float("-inf")
        self.serving: list[int] = list(range(len(actors)))  # in the weight group, in slot order
        self.joined_at = [0.0] * len(actors)  # calls launched before this belong to an earlier life
        self.restarting: dict[int, Restarting] = {}
        self.reform = False  # a member left: the group must be re-formed before the next sync
        self.timeout_s = restart_timeout_s
        self.deaths = 0
        """Actors that died (Ray restarts them): `rollout_restarts`."""
        self.stalls = 0
        """Actors taken out because they stopped answering: `rollout_stalls` (one that then
        turns out dead counts in `deaths` as well)."""

    def lost(self, actor: int, launched_at: float, stalled: bool = False) -> bool:
        """A call to `actor` launched at `launched_at` (perf_counter) failed because the actor
        died (`stalled`: it stopped answering). True when this is news: the actor leaves the
        group (or, joining, died again; or, stalled, died) and is watched until back."""
        now = time.perf_counter()
        if actor in self.restarting:
            away = self.restarting[actor]
            if away.stalled and not stalled:  # the actor that stopped answering died: a restart now
                self.deaths += 1
                self.restarting[actor] = Restarting(away.left_at, lost_at=now)
                return True
            # a call launched before the death already counted is of that life, however late it
            # fails (a driver held up until the restart was ready reads those failures then)
            if launched_at < away.lost_at:
                return False
            news = away.ready  # died again while joining: watch its next restart
            if news:
                self.deaths += 1
            self.restarting[actor] = Restarting(
                away.left_at, lost_at=now if news else away.lost_at, stalled=away.stalled
            )
            return news
        if actor not in self.serving or launched_at < self.joined_at[actor]:
            return False
        self.serving.remove(actor)
        self.reform = True
        self.restarting[actor] = Restarting(now, lost_at=now, stalled=stalled)
        if stalled:
            self.stalls += 1
        else:
            self.deaths += 1
        return True

    def back_from_stall(self, actor: int) -> bool:
        """Whether `actor`, away, left by stalling and answered again without a restart."""
        r = self.restarting.get(actor)
        return r is not None and r.stalled

    def probes(self) -> list[ray.ObjectRef]:
        """`ready()` calls in flight (the driver's wait wakes when one answers; `poll` clears
        answered ones, so a finished probe never keeps the wait returning at once)."""
        return [r.probe for r in self.restarting.values() if r.probe is not None]

    def poll(self) -> list[int]:
        """Never blocks. Returns the restarted actors whose constructor has run (ready to join).
        Raises RunError for an actor whose restarts are exhausted or that is not back in time."""
        now = time.perf_counter()
        away = [i for i, r in self.restarting.items() if not r.ready and not r.stalled]
        if away and now - self._capacity_at >= CAPACITY_BEAT_S:
            self._capacity_at = now
            gone = self.capacity()
            if gone and gone != self.gone:
                log.warning(
                    "rollout actor(s) %s away: %s; waiting up to %.0fs (rollout.generate_timeout_s) for such "
                    "a node to join",
                    ", ".join(map(str, away)),
                    gone,
                    self.timeout_s,
                    extra=event("capacity_gone", group="rollout", actors=away),
                )
            self.gone = gone
        for i, r in self.restarting.items():
            if r.ready:
                continue
            if now - r.left_at > self.timeout_s:
                if self.gone:
                    raise RunError(
                        f"rollout actor {i} could not be restarted: {self.gone}; no node joined within "
                        f"rollout.generate_timeout_s={self.timeout_s:g}s"
                    )
                raise RunError(
                    f"rollout actor {i} was not back within rollout.generate_timeout_s="
                    f"{self.timeout_s:g}s of its restart"
                )
            if r.probe is None:
                if now >= r.retry_at:
                    r.probe = self.actors[i].ready.remote()
                continue
            done, _ = ray.wait([r.probe], timeout=0)
            if not done:
                continue
            try:
                ray.get(r.probe, timeout=0)
                r.ready = True
            except ray.exceptions.ActorDiedError as exc:
                raise RunError(f"rollout actor {i} died for good (rollout.max_restarts exhausted): {exc}") from exc
            except ray.exceptions.RayError:  # still restarting: ask again shortly
                r.retry_at = now + PROBE_RETRY_S
                if r.stalled:  # Ray restarts it: a stall that ended in a death
                    r.stalled, r.lost_at = False, now
                    self.deaths += 1
            r.probe = None
        return sorted(i for i, r in self.restarting.items() if r.ready)

    def admit(self, actors: list[int]) -> list[int]:
        """`actors` are in the re-formed group and hold the current weights: they serve again
        (one that died again meanwhile is left out)."""
        now = time.perf_counter()
        actors = [i for i in actors if i in self.restarting and self.restarting[i].ready]
        for i in actors:
            del self.restarting[i]
            self.joined_at[i] = now
        self.serving = sorted(self.serving + list(actors))
        return actors

    def busy_seconds(self) -> float | None:
        """Generation seconds summed over the serving actors; None when one does not answer
        within 10 s or was restarted (busy accounting must never stall or fail training)."""
        refs = [self.actors[i].busy_seconds.remote() for i in self.serving]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=10.0)
        if len(ready) < len(refs):
            return None
        try:
            return sum(ray.get(ready))
        except ray.exceptions.RayError:
            return None
