"""Remote calls with deadlines: every blocking `ray.get` of the drivers goes through `get`, so a
dead or stuck peer becomes one `RunError` that names the operation and the participant."""

from __future__ import annotations

import time

import ray

from rlcore.faults import NotInWeightGroup, memory_kill


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
        done, pending = ray.wait(list(_UNREAD), num_returns=len(_UNREAD), timeout=0)
        for ref in done:
            try:
                ray.get(ref, timeout=0)
            except ray.exceptions.RayError:
                pass
        _UNREAD[:] = pending[-_UNREAD_LIMIT:]
    return len(_UNREAD)


def get(refs, timeout_s: float, what: str, names: list[str] | None = None):
    """`ray.get` with a timeout and an error that names the operation and, given `names` (one per
    ref), which participant died or failed. When it fails, the other refs of the call are kept
    and read once they finish (`read_unread`, run by every `get`)."""
    read_unread()
    try:
        return ray.get(refs, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError as exc:
        _keep_unread(refs)
        raise RunError(f"{what} did not finish within {timeout_s:.0f}s") from exc
    except ray.exceptions.RayError as exc:
        _keep_unread(refs)
        if not died(exc):
            raise
        dead = failed_names(refs, names)
        how = memory_kill(str(exc)) or ("was restarted and has not rejoined the weight group"
                                        if isinstance(_cause(exc), NotInWeightGroup) else "died")
        raise ActorDied(f"{what} failed: {', '.join(dead) or 'an actor'} {how} ({exc})", dead, how) from exc


def _cause(exc: BaseException):
    return getattr(exc, "cause", None) if isinstance(exc, ray.exceptions.RayTaskError) else None


def died(exc: BaseException) -> bool:
    """Whether a call failed because its actor's process is gone: it died, Ray's memory monitor
    killed it (`OutOfMemoryError`), or it is a restarted process not yet back in the group."""
    return (isinstance(exc, (ray.exceptions.RayActorError, ray.exceptions.OutOfMemoryError))
            or memory_kill(str(exc)) is not None or isinstance(_cause(exc), NotInWeightGroup))


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


def wait_ready(actors: list, timeout_s: float) -> None:
    """Wait until every actor answers `ready()`, riding out restarts (an actor Ray is restarting
    answers "unavailable" until its constructor has run again)."""
    deadline = time.monotonic() + timeout_s
    pending = list(actors)
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            raise RunError(f"{len(pending)} rollout actor(s) not ready within {timeout_s:.0f}s")
        still = []
        for actor in pending:
            try:
                ray.get(actor.ready.remote(), timeout=min(left, 30.0))
            except (ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError):
                still.append(actor)
            except ray.exceptions.ActorDiedError as exc:
                raise RunError(f"a rollout actor died for good (restarts exhausted): {exc}") from exc
        pending = still
        if pending:
            time.sleep(0.5)


def refs_ready(refs: list[ray.ObjectRef]) -> bool:
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
    return len(ready) == len(refs)
