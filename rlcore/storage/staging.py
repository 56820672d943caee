"""The local staging folder of an object-store `output_dir` (`rlcore.storage.location`).

A run appends to its series (metrics.jsonl, samples, data order, events, logs) and an object
store cannot append, so those files live in a staging folder on the driver's node and are
uploaded whole to `storage.url`:
- before the run: :func:`download` empties the staging folder and fills it with what the URL
  holds (checkpoints and the exported model stay in the store), so a resume keeps the earlier
  rows and a fresh run sees that the URL already holds a run, as on a filesystem;
- during the run: :func:`upload` at every committed checkpoint, and :class:`Sync` every
  `storage.sync_interval_s` from a thread;
- at the end, also after a failure or a signal: :class:`Sync`'s exit.

Two runs on one URL: the staging folder's `flock` guards one machine; across machines the run
keeps a lease object (``URL/.lease``: owner and heartbeat time, renewed every
:data:`HEARTBEAT_S`), and a run that finds a lease renewed less than :data:`LEASE_STALE_S` ago
is refused (unless its owner is a process of this machine that is gone). A lease is not a lock: two runs started within one heartbeat of each other on
different machines are not told apart.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import socket
import sys
import threading
import time
from pathlib import Path

from rlcore.config.errors import ConfigError
from rlcore.storage.errors import short_storage_error, storage_cause

log = logging.getLogger("rlcore")

LEASE = ".lease"
"""The lease object under the URL: {"owner": host:pid, "time": heartbeat (epoch seconds)}."""
HEARTBEAT_S = 30.0
"""How often a live run renews its lease."""
LEASE_STALE_S = 120.0
"""A lease not renewed for this long belongs to a run that is gone."""
LOCAL_ONLY = (".lock",)
"""Staging files that are never uploaded (the staging folder's own flock)."""

_upload_lock = threading.Lock()  # the sync thread and a checkpoint's commit upload in turn


def _fs(url: str):
    from fsspec.core import url_to_fs

    return url_to_fs(url)


def _why(exc: BaseException) -> str:
    """A store's error in a few words: its cause (`rlcore.storage.errors.storage_cause`) and the
    error's first line, cut short."""
    first = next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), "")[:150]
    cause = storage_cause(exc)
    return f"{cause} ({type(exc).__name__}: {first})" if cause else f"{type(exc).__name__}: {first}"


def _kept_in_store(cfg) -> tuple[str, ...]:
    """Store prefixes a download leaves where they are: checkpoints and the exported model."""
    return tuple(str(p).rstrip("/") + "/" for p in (cfg.checkpoint.dir, cfg.checkpoint.export_dir) if p)


def lease_holder(cfg, now: float | None = None) -> str | None:
    """Who holds the URL's lease now ("host:pid, renewed Ns ago"), or None: no lease, a stale
    one, or one of a process of this machine that is gone (a run killed with SIGKILL)."""
    fs, root = _fs(cfg.storage.url)
    try:
        fs.invalidate_cache()
        lease = json.loads(fs.cat_file(f"{root}/{LEASE}"))
        owner = str(lease["owner"])
        age = (time.time() if now is None else now) - float(lease["time"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError):
        return f"its {LEASE} object is unreadable; delete it if no run uses this URL"
    host, _, pid = owner.rpartition(":")
    if host == socket.gethostname() and pid.isdigit() and not _alive(int(pid)):
        return None
    return f"{owner}, renewed {age:.0f}s ago" if age < LEASE_STALE_S else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _staging_held(out: Path) -> bool:
    """Whether a live run on this machine holds the staging folder's flock."""
    try:
        with open(out / ".lock", "a+") as fh:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)
    except BlockingIOError:
        return True
    except OSError:
        return False
    return False


def download(cfg) -> int:
    """Refill `output_dir` (the staging folder) from `storage.url`: refused (ConfigError naming
    `output_dir`) while a live run holds it here or its lease; else the staging folder is emptied
    and every object under the URL but checkpoints, the exported model and the lease is copied
    in. Returns the files copied. A config without `storage.url` is left alone (0)."""
    url = cfg.storage.url
    if not url:
        return 0
    out = Path(cfg.output_dir)
    if out.is_dir() and _staging_held(out):
        raise ConfigError(
            "output_dir",
            f"{url!r} is in use by another run on this machine (staging folder {out}); "
            "wait for it to finish, or choose another output_dir",
        )
    try:
        holder = lease_holder(cfg)
        if holder:
            raise ConfigError(
                "output_dir",
                f"{url!r} is in use by another run ({holder}; a run renews its "
                f"{LEASE} every {HEARTBEAT_S:.0f}s); wait for it to finish, or choose another output_dir",
            )
        fs, root = _fs(url)
        keep = _kept_in_store(cfg)
        found = [p for p in fs.find(root) if p != f"{root}/{LEASE}"]
        found = [p for p in found if not any(fs.unstrip_protocol(p).startswith(k) for k in keep)]
        if out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True)
        if found:
            fs.get(found, [str(out / p[len(root) + 1 :]) for p in found])
    except ConfigError:
        raise
    except Exception as exc:  # credentials, a missing bucket, the network: before Ray starts, one line
        raise ConfigError("output_dir", f"{url!r} cannot be read: {_why(exc)}") from None
    return len(found)


def upload(cfg) -> int:
    """Copy every file of the staging folder (but its flock) to `storage.url`, replacing what is
    there. Returns the files copied; raises the store's error. (The lease is `Sync`'s own
    thread's: an upload that ends late never renews a lease released meanwhile.)"""
    url = cfg.storage.url
    if not url:
        return 0
    out = Path(cfg.output_dir)
    fs, root = _fs(url)
    with _upload_lock:
        files = [p for p in sorted(out.rglob("*")) if p.is_file() and p.name not in LOCAL_ONLY]
        if files:
            fs.put([str(p) for p in files], [f"{root}/{p.relative_to(out).as_posix()}" for p in files])
    return len(files)


class NoAnswer(TimeoutError):
    """The store did not answer within the deadline."""


NOTICE_S = 5.0
"""An upload still running after this long is named in one line (the URL and the deadline)."""
PROBE_S = 10.0
"""On the way out of a run whose store went unanswered: how long a lease write may take to show
the store is back before the last upload is tried (not the full `checkpoint.timeout_s` again)."""
UNANSWERED = threading.Event()
"""Set once a store call of this process ran past its deadline (`within`)."""


def within(work, timeout_s: float, what: str = "", where: str = ""):
    """`work()` (a call to an object store) in a thread of its own, waited for `timeout_s`
    (`checkpoint.timeout_s`); returns its result or raises its error. Given `what` and `where`
    (the URL), one line names them and the deadline once it has run :data:`NOTICE_S`. A store that
    does not answer in time is `NoAnswer` naming them (the thread is left to finish)."""
    result: list = []
    failed: list[BaseException] = []

    def run():
        try:
            result.append(work())
        except Exception as exc:
            failed.append(exc)

    t = threading.Thread(target=run, name="rlcore-storage-call", daemon=True)
    t.start()
    t.join(min(NOTICE_S, timeout_s) if what else timeout_s)
    if t.is_alive() and what and timeout_s > NOTICE_S:
        log.warning(
            "%s %s: no answer from the store for %gs; waiting up to %.0fs more (checkpoint.timeout_s)",
            what,
            where,
            NOTICE_S,
            timeout_s - NOTICE_S,
        )
        t.join(timeout_s - NOTICE_S)
    if t.is_alive():
        UNANSWERED.set()
        named = f"{what} {where}: " if what else ""
        raise NoAnswer(f"{named}storage unreachable (no answer within {timeout_s:g}s, checkpoint.timeout_s)")
    if failed:
        raise failed[0]
    return result[0]


def upload_within(cfg, timeout_s: float, what: str = "uploading the run's files") -> bool:
    """:func:`upload` bounded by `timeout_s` (`checkpoint.timeout_s`): run in a thread of its own;
    one line names the URL and the deadline once it has run :data:`NOTICE_S`, and at the deadline
    the run goes on without it (one warning; the upload finishes or fails in its thread, and the
    next upload sends the files again). Returns whether it finished; a failure is one warning
    naming the cause. The lease is renewed by `Sync`'s own thread meanwhile."""
    if not cfg.storage.url:
        return True
    try:
        within(lambda: upload(cfg), timeout_s, what + " to", cfg.storage.url)
    except NoAnswer:
        log.warning(
            "%s to %s: not done within %gs (checkpoint.timeout_s); the run goes on, the next upload sends them again",
            what,
            cfg.storage.url,
            timeout_s,
        )
        return False
    except Exception as exc:
        log.warning("%s (retried later)", short_storage_error(what + " to", cfg.storage.url, exc))
        return False
    return True


def claim(cfg) -> None:
    """Take the URL's lease for this run (after :func:`download` found it free); ConfigError
    naming `output_dir` when the store cannot be written. Nothing without `storage.url`."""
    if not cfg.storage.url:
        return
    try:
        renew_lease(cfg)
    except Exception as exc:  # credentials, permissions, a missing bucket: before Ray starts, one line
        raise ConfigError("output_dir", f"{cfg.storage.url!r} cannot be written: {_why(exc)}") from None


def renew_lease(cfg) -> None:
    fs, root = _fs(cfg.storage.url)
    fs.pipe_file(
        f"{root}/{LEASE}", json.dumps({"owner": f"{socket.gethostname()}:{os.getpid()}", "time": time.time()}).encode()
    )


def release_lease(cfg) -> None:
    fs, root = _fs(cfg.storage.url)
    try:
        fs.rm_file(f"{root}/{LEASE}")
    except FileNotFoundError:
        pass


class Sync:
    """For the life of a run with an object-store `output_dir` (a context manager; nothing
    without one): the lease renewed every :data:`HEARTBEAT_S` from a thread of its own (an upload
    that is slow or hangs never lets it go stale), the staging folder uploaded every
    `storage.sync_interval_s` from another (0: only at checkpoints and at the end), and on exit
    (however the run ended) a last upload and the lease released. A failed periodic upload is a
    warning (the next one retries); a failed last upload is an error line on stderr. A run that
    was refused before it began (:meth:`discard`) uploads nothing: only its lease is released."""

    def __init__(self, cfg):
        self.cfg = cfg
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.failed: str | None = None
        self.discarded = False

    def __enter__(self) -> Sync:
        UNANSWERED.clear()  # a run before this one in the process (a test, a sweep) left it set
        if self.cfg.storage.url:  # the lease is taken already (claim)
            self._threads = [threading.Thread(target=self._renew, name="rlcore-storage-lease", daemon=True)]
            if float(self.cfg.storage.sync_interval_s or 0) > 0:
                self._threads.append(threading.Thread(target=self._upload, name="rlcore-storage-sync", daemon=True))
            for t in self._threads:
                t.start()
        return self

    def discard(self) -> None:
        """The run was refused before it began (a config error found after the claim, Ray that
        would not start): nothing of it is uploaded at the end."""
        self.discarded = True

    def _renew(self) -> None:
        warned = False
        while not self._stop.wait(HEARTBEAT_S):
            try:
                renew_lease(self.cfg)
                warned = False
            except Exception as exc:  # the store is away for now: say so once, the next beat retries
                if not warned:
                    warned = True
                    log.warning(
                        "renewing the run's lease %s/%s failed (retried every %.0fs; another run may take "
                        "the URL once it is %.0fs old): %s",
                        self.cfg.storage.url,
                        LEASE,
                        HEARTBEAT_S,
                        LEASE_STALE_S,
                        short_storage_error("renewing", self.cfg.storage.url, exc),
                    )

    def _upload(self) -> None:
        while not self._stop.wait(float(self.cfg.storage.sync_interval_s)):
            try:
                upload(self.cfg)
            except Exception as exc:  # the store is away for now: say so, the next tick retries
                log.warning(
                    "%s (retried)", short_storage_error("uploading the run's files to", self.cfg.storage.url, exc)
                )

    def __exit__(self, *exc) -> None:
        if not self._threads:
            return
        self._stop.set()
        # a store that already left a call unanswered gets no second full deadline on the way out:
        # one lease write (PROBE_S) says whether it is back before the last upload is tried
        gone = UNANSWERED.is_set()
        wait_s = 0.0 if gone else min(HEARTBEAT_S, float(self.cfg.checkpoint.timeout_s))
        for t in self._threads:
            t.join(timeout=min(NOTICE_S, wait_s))
            if t.is_alive() and wait_s > NOTICE_S:  # a renewal or an upload the store has not answered
                log.warning(
                    "%s %s: no answer from the store for %gs; waiting up to %.0fs more before the last upload",
                    "renewing the run's lease in" if t.name.endswith("lease") else "uploading to",
                    self.cfg.storage.url,
                    NOTICE_S,
                    wait_s - NOTICE_S,
                )
                t.join(timeout=wait_s - NOTICE_S)
        try:
            if gone or any(t.is_alive() for t in self._threads):
                try:
                    within(lambda: renew_lease(self.cfg), PROBE_S)
                except NoAnswer:
                    raise NoAnswer(
                        f"storage unreachable: it left a call unanswered in this run and a lease write "
                        f"now within {PROBE_S:g}s; not waiting checkpoint.timeout_s again"
                    ) from None
            if not self.discarded:
                within(
                    lambda: upload(self.cfg),
                    float(self.cfg.checkpoint.timeout_s),
                    "the last upload of the run's files to",
                    self.cfg.storage.url,
                )
            within(lambda: release_lease(self.cfg), PROBE_S)
        except Exception as err:
            self.failed = (
                str(err)
                if isinstance(err, NoAnswer)  # names the call and its deadline already
                else storage_cause(err) or f"{type(err).__name__}: {str(err).splitlines()[0][:150] if str(err) else ''}"
            )
            log.debug("the last upload to %s failed", self.cfg.storage.url, exc_info=True)
            print(
                f"rlcore: error: the run's files were not uploaded to {self.cfg.storage.url} ({self.failed}); "
                f"they are in {self.cfg.output_dir}",
                flush=True,
                file=sys.stderr,
            )
