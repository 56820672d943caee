"""Remote calls with deadlines: every blocking `ray.get` of the drivers goes through `get`, so a
dead or stuck peer becomes one `RunError` that names the operation and the participant."""

from __future__ import annotations

import logging
import time
from typing import Callable

import ray

from rlcore.report.faults import NotInWeightGroup, memory_kill

log = logging.getLogger("rlcore")


class RunError(RuntimeError):
    """A fault that stops the run, with a message that says where."""


class ActorDied(RunError):
    """A remote call failed because its actor died; `dead` names the participants, `how` says
    how they went (died, killed by Ray's memory monitor with the node's figures, restarted)."""

    def __init__(self, message: str, dead: list[str], how: str = "died"):
        super().__init__(message)
        self.dead = dead
        self.how = how


_UNREAD: list = []
"""Refs of a failed `get` that were not read: held until they finish, then read (see `get`)."""
_UNREAD_LIMIT = 10_000


def read_unread() -> int:
    """Read (and drop) the errors of the refs a failed `get` left behind that have finished since;
    returns how many are still pending. Ray prints every error object nobody read as an
    "Unhandled error" traceback once its ref is dropped; a fault the run already handled (one
    engine's death failing the other engines' half of a weight sync) must not read as a crash."""
    if _UNREAD:
        try:
            done, pending = ray.wait(list(_UNREAD), num_returns=len(_UNREAD), timeout=0)
        except ValueError:  # refs of an earlier Ray session (a sweep's previous job, a test's): gone with it
            _UNREAD.clear()
            return 0
        for ref in done:
            try:
                ray.get(ref, timeout=0)
            except ray.exceptions.RayError:
                pass
        _UNREAD[:] = pending[-_UNREAD_LIMIT:]
    return len(_UNREAD)


def get(
    refs,
    timeout_s: float,
    what: str,
    names: list[str] | None = None,
    stalled: Callable[[], list[str]] | None = None,
    notice: str | None = None,
):
    """`ray.get` with a timeout and an error that names the operation and, given `names` (one per
    ref), which participant died or failed. When it fails, the other refs of the call are kept
    and read once they finish (`read_unread`, run by every `get`). `stalled()`, asked every
    second while waiting, names participants seen frozen (`actors.stall_watch`): one of `names`
    ends the wait at once with an `ActorDied` naming it (how: "made no progress"); so does a
    participant whose call failed, as in a plain `ray.get` of the list. `notice` (e.g. the
    storage URL a checkpoint writes to): a wait still open after `WAIT_NOTICE_S` is named in one
    line: what, the participants not done, `notice`, and how long it will wait."""
    read_unread()
    try:
        if (stalled is not None or notice is not None) and isinstance(refs, list):
            _wait_unless_stalled(refs, timeout_s, what, names or [], stalled or (lambda: []), notice)
        return ray.get(refs, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError as exc:
        _keep_unread(refs)
        raise RunError(f"{what} did not finish within {timeout_s:.0f}s") from exc
    except ray.exceptions.RayError as exc:
        _keep_unread(refs)
        if not died(exc):
            # a rank whose collective broke because its peer died (a killed node) often answers
            # first, with a transport error: the death it follows is what the caller must see
            dead = peers_that_died(refs, names, min(timeout_s, PEER_GRACE_S)) if lost_peer(exc) else []
            if not dead:
                raise
            raise ActorDied(
                f"{what} failed: {', '.join(dead)} died (a peer's collective broke: {str(exc).splitlines()[0][:200]})",
                dead,
            ) from exc
        dead = failed_names(refs, names)
        how = memory_kill(str(exc)) or (
            "was restarted and has not rejoined the weight group"
            if isinstance(_cause(exc), NotInWeightGroup)
            else "died"
        )
        raise ActorDied(f"{what} failed: {', '.join(dead) or 'an actor'} {how} ({exc})", dead, how) from exc


WAIT_NOTICE_S = 5.0
"""A named wait (`get`'s `notice`) still open after this long says so in one line."""


def _wait_unless_stalled(
    refs: list,
    timeout_s: float,
    what: str,
    names: list[str],
    stalled: Callable[[], list[str]],
    notice: str | None = None,
) -> None:
    start = time.monotonic()
    deadline, pending = start + timeout_s, list(refs)
    said = notice is None
    while pending and time.monotonic() < deadline:
        if not said and time.monotonic() - start >= WAIT_NOTICE_S:
            said = True
            ids = {r.binary() for r in pending}
            waiting = [n for r, n in zip(refs, names) if r.binary() in ids] if len(names) == len(refs) else []
            log.warning(
                "%s: waiting for %s (%s); up to %.0fs more",
                what,
                ", ".join(waiting) or "its participants",
                notice,
                max(0.0, deadline - time.monotonic()),
            )
        ready, pending = ray.wait(
            pending, num_returns=len(pending), timeout=min(1.0, max(0.0, deadline - time.monotonic()))
        )
        for ref in ready:
            # a participant that failed (died) ends the wait, as a plain `ray.get` of the list
            # does: the others may be blocked in a collective with it until their own deadline
            ray.get(ref, timeout=0)
        frozen = [n for n in stalled() if n in names]
        if frozen and pending:
            _keep_unread(refs)
            raise ActorDied(f"{what} failed: {', '.join(frozen)} made no progress", frozen, "made no progress")


PEER_GRACE_S = 60.0
"""The longest a call whose participant reported a broken collective waits for another to be seen
dead (Ray marks an actor on a killed node dead only once it declares the node dead: seconds to tens)."""

_LOST_PEER = (
    "Connection reset",
    "Connection closed",
    "Broken pipe",
    "Connection refused",
    "gloo",
    "NCCL",
    "ProcessGroup",
)


def lost_peer(exc: BaseException) -> bool:
    """Whether a task error reads as a collective whose peer went away (gloo / NCCL transport)."""
    return isinstance(exc, ray.exceptions.RayTaskError) and any(s in str(exc) for s in _LOST_PEER)


def peers_that_died(refs, names: list[str] | None, wait_s: float) -> list[str]:
    """The participants of a call (one ref each, named by `names`) whose actor died: as soon as
    one answers as dead, else once every ref answered or `wait_s` passed. Not a wait for all of
    them: a live participant blocked in the broken collective answers only at its own timeout."""
    if not names or not isinstance(refs, list) or len(refs) < 2:
        return []
    deadline, pending = time.monotonic() + wait_s, list(refs)
    while pending and not failed_names(refs, names):
        left = deadline - time.monotonic()
        if left <= 0:
            break
        ready, pending = ray.wait(pending, num_returns=1, timeout=left)
        if not ready:
            break
    return failed_names(refs, names)


def _cause(exc: BaseException):
    return getattr(exc, "cause", None) if isinstance(exc, ray.exceptions.RayTaskError) else None


def died(exc: BaseException) -> bool:
    """Whether a call failed because its actor's process is gone: it died, Ray's memory monitor
    killed it (`OutOfMemoryError`), or it is a restarted process not yet back in the group."""
    return (
        isinstance(exc, (ray.exceptions.RayActorError, ray.exceptions.OutOfMemoryError))
        or memory_kill(str(exc)) is not None
        or isinstance(_cause(exc), NotInWeightGroup)
    )


def forget(refs: list) -> None:
    """Refs nobody needs any more: read (and dropped) once they finish, like a failed `get`'s."""
    _keep_unread(refs)


def _keep_unread(refs) -> None:
    kept = dict.fromkeys(_UNREAD)  # ray.wait takes each ref once
    kept.update(dict.fromkeys(refs if isinstance(refs, list) else [refs]))
    _UNREAD[:] = list(kept)
    read_unread()


def failed_names(refs, names: list[str] | None) -> list[str]:
    if not names or not isinstance(refs, list):
        return []
    dead = []
    for ref, name in zip(refs, names):
        try:
            ray.get(ref, timeout=0)
        except ray.exceptions.RayError as exc:
            if died(exc):
                dead.append(name)
    return dead


class ReadyWatch:
    """The `ready()` answers of a set of actors, watched without blocking so that other start-up
    work runs meanwhile. `what` names them in errors ("rollout actor" -> "rollout actor 1").

    An actor Ray is restarting answers "unavailable" until its constructor has run again: it is
    asked again (`RETRY_S` later). One that died for good (its restarts exhausted), or any left
    unanswered `timeout_s` after the watch began, is a `RunError`."""

    RETRY_S = 0.5

    def __init__(self, actors: list, timeout_s: float, what: str):
        self.actors, self.timeout_s, self.what = list(actors), timeout_s, what
        self.started = time.monotonic()
        self.deadline = self.started + timeout_s
        self.probes: dict[int, ray.ObjectRef] = {i: a.ready.remote() for i, a in enumerate(self.actors)}
        self.retry_at: dict[int, float] = {}  # asked again at this time (was unavailable)
        self.ready_s: float | None = None
        """Seconds from the watch's start until every actor had answered; None until then."""

    @property
    def done(self) -> bool:
        return self.ready_s is not None

    def poll(self) -> bool:
        """Never blocks: reads the answers that came, re-asks actors that were restarting.
        Returns whether every actor is ready; raises RunError as the class says."""
        if self.done:
            return True
        now = time.monotonic()
        for i, t in list(self.retry_at.items()):
            if now >= t:
                del self.retry_at[i]
                self.probes[i] = self.actors[i].ready.remote()
        if self.probes:
            finished, _ = ray.wait(list(self.probes.values()), num_returns=len(self.probes), timeout=0)
            finished = set(finished)
            for i, ref in list(self.probes.items()):
                if ref not in finished:
                    continue
                del self.probes[i]
                try:
                    ray.get(ref, timeout=0)
                except (ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError):
                    self.retry_at[i] = now + self.RETRY_S
                except ray.exceptions.RayActorError as exc:
                    raise RunError(f"{self.what} {i} died while starting (restarts exhausted): {exc}") from exc
        if not self.probes and not self.retry_at:
            self.ready_s = time.monotonic() - self.started
            return True
        if now > self.deadline:
            waiting = sorted(set(self.probes) | set(self.retry_at))
            raise RunError(f"{self.what}(s) {', '.join(map(str, waiting))} not ready within {self.timeout_s:.0f}s")
        return False

    def join(self) -> float:
        """Block until every actor is ready (or RunError); returns `ready_s`."""
        while not self.poll():
            pending = list(self.probes.values())
            left = max(0.0, self.deadline - time.monotonic()) + 0.01
            if pending:
                ray.wait(pending, num_returns=1, timeout=min(self.RETRY_S, left))
            else:
                time.sleep(min(self.RETRY_S, left))
        return self.ready_s


def refs_ready(refs: list[ray.ObjectRef]) -> bool:
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
    return len(ready) == len(refs)
