"""Storage faults named for what they are: an OSError, a botocore, pyarrow or fsspec error, or a
torch writer's error found anywhere in an exception's chain becomes one short cause (no space left
on device, permission denied, storage unreachable, throttled, ...) that the run's one error line
carries with the path or URL; the whole chain stays in the run's log. Torch-, Ray- and boto-free
(botocore's errors are recognised by their class names and codes)."""

from __future__ import annotations

import errno

NO_SPACE = "no space left on device"

_ERRNO_CAUSES = {
    errno.ENOSPC: NO_SPACE,
    errno.EDQUOT: "disk quota exceeded",
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
    errno.EROFS: "read-only file system",
    errno.ENOENT: "no such file or directory",
    errno.EIO: "input/output error",
    errno.ECONNREFUSED: "storage unreachable",
    errno.ECONNRESET: "storage unreachable",
    errno.EHOSTUNREACH: "storage unreachable",
    errno.ENETUNREACH: "storage unreachable",
    errno.ETIMEDOUT: "storage unreachable (timed out)",
}
# what the text of an error says when no errno survived the layers it crossed (torch's zip writer,
# pyarrow, botocore): first match wins, so the specific ones come first
_TEXT_CAUSES = (
    ("no space left on device", NO_SPACE),
    ("enospc", NO_SPACE),
    ("disk quota exceeded", "disk quota exceeded"),
    ("slowdown", "throttled"),
    ("throttl", "throttled"),
    ("too many requests", "throttled"),
    ("requestlimitexceeded", "throttled"),
    ("accessdenied", "permission denied"),
    ("access denied", "permission denied"),
    ("permission denied", "permission denied"),
    ("forbidden", "permission denied"),
    ("invalidaccesskeyid", "permission denied (credentials)"),
    ("signaturedoesnotmatch", "permission denied (credentials)"),
    ("nosuchbucket", "no such bucket"),
    ("read-only file system", "read-only file system"),
    ("could not connect to the endpoint", "storage unreachable"),
    ("connection refused", "storage unreachable"),
    ("connect timeout", "storage unreachable (timed out)"),
    ("read timeout", "storage unreachable (timed out)"),
    ("endpointconnectionerror", "storage unreachable"),
    ("name or service not known", "storage unreachable"),
)
_UNREACHABLE_CLASSES = (
    "EndpointConnectionError",
    "ConnectTimeoutError",
    "ReadTimeoutError",
    "ConnectionClosedError",
    "ServerDisconnectedError",
    "ClientConnectorError",
    "NoAnswer",
)  # NoAnswer: rlcore.storage.staging's, a store that did not answer in time


def _chain(exc: BaseException):
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def storage_cause(exc: BaseException) -> str | None:
    """The short cause of a storage error (`NO_SPACE`, "permission denied", "storage
    unreachable", "throttled", ...) found anywhere in `exc`'s chain, or None when none reads as
    one. An errno wins over text; a nested error's text is read as well (torch and Ray wrap)."""
    chain = list(_chain(exc))
    for e in chain:
        if isinstance(e, OSError) and e.errno in _ERRNO_CAUSES:
            return _ERRNO_CAUSES[e.errno]
        if type(e).__name__ in _UNREACHABLE_CLASSES or isinstance(e, ConnectionError):
            return "storage unreachable"
        code = (
            str(getattr(e, "response", {}).get("Error", {}).get("Code", ""))
            if isinstance(getattr(e, "response", None), dict)
            else ""
        )
        if code:
            for needle, cause in _TEXT_CAUSES:
                if needle in code.lower():
                    return cause
    for e in chain:
        text = str(e).lower()
        for needle, cause in _TEXT_CAUSES:
            if needle in text:
                return cause
    return None


def short_storage_error(what: str, where: str, exc: BaseException, limit: int = 200) -> str:
    """One short line: "`what` `where`: CAUSE" (the cause from :func:`storage_cause`, else the
    error's type and the first line of its text, cut to fit `limit` characters)."""
    cause = storage_cause(exc)
    if cause is None:
        first = next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), "")
        cause = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
    line = f"{what} {where}: {cause}"
    return line if len(line) <= limit else line[: limit - 3] + "..."


class StorageError(RuntimeError):
    """A write or read of the run's storage failed; the message is one short line naming what,
    where and why (:func:`short_storage_error`); the original error is its `__cause__`."""

    def __init__(self, what: str, where: str, exc: BaseException):
        super().__init__(short_storage_error(what, where, exc))
        self.where = where
        self.cause = storage_cause(exc)
