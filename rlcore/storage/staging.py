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
        raise ConfigError("output_dir", f"{url!r} is in use by another run on this machine (staging folder {out}); "
                          "wait for it to finish, or choose another output_dir")
    try:
        holder = lease_holder(cfg)
        if holder:
            raise ConfigError("output_dir", f"{url!r} is in use by another run ({holder}; a run renews its "
                              f"{LEASE} every {HEARTBEAT_S:.0f}s); wait for it to finish, or choose another output_dir")
        fs, root = _fs(url)
        keep = _kept_in_store(cfg)
        found = [p for p in fs.find(root) if p != f"{root}/{LEASE}"]
        found = [p for p in found if not any(fs.unstrip_protocol(p).startswith(k) for k in keep)]
        if out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True)
        if found:
            fs.get(found, [str(out / p[len(root) + 1:]) for p in found])
    except ConfigError:
        raise
    except Exception as exc:  # credentials, a missing bucket, the network: before Ray starts, one line
        raise ConfigError("output_dir", f"{url!r} cannot be read: {type(exc).__name__}: {exc}") from None
    return len(found)


def upload(cfg) -> int:
    """Copy every file of the staging folder (but its flock) to `storage.url`, replacing what is
    there, and renew the lease. Returns the files copied; raises the store's error."""
    url = cfg.storage.url
    if not url:
        return 0
    out = Path(cfg.output_dir)
    fs, root = _fs(url)
    with _upload_lock:
        files = [p for p in sorted(out.rglob("*")) if p.is_file() and p.name not in LOCAL_ONLY]
        if files:
            fs.put([str(p) for p in files], [f"{root}/{p.relative_to(out).as_posix()}" for p in files])
        renew_lease(cfg)
    return len(files)


def claim(cfg) -> None:
    """Take the URL's lease for this run (after :func:`download` found it free); ConfigError
    naming `output_dir` when the store cannot be written. Nothing without `storage.url`."""
    if not cfg.storage.url:
        return
    try:
        renew_lease(cfg)
    except Exception as exc:  # credentials, permissions, a missing bucket: before Ray starts, one line
        raise ConfigError("output_dir", f"{cfg.storage.url!r} cannot be written: {type(exc).__name__}: {exc}") from None


def renew_lease(cfg) -> None:
    fs, root = _fs(cfg.storage.url)
    fs.pipe_file(f"{root}/{LEASE}", json.dumps({"owner": f"{socket.gethostname()}:{os.getpid()}",
                                                 "time": time.time()}).encode())


def release_lease(cfg) -> None:
    fs, root = _fs(cfg.storage.url)
    try:
        fs.rm_file(f"{root}/{LEASE}")
    except FileNotFoundError:
        pass


class Sync:
    """For the life of a run with an object-store `output_dir` (a context manager; nothing
    without one): the lease renewed every :data:`HEARTBEAT_S`, the staging folder uploaded every
    `storage.sync_interval_s` (0: only at checkpoints and at the end), and on exit (however the
    run ended) a last upload and the lease released. A failed periodic upload is a warning
    (the next one retries); a failed last upload is an error line on stderr."""

    def __init__(self, cfg):
        self.cfg = cfg
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.failed: str | None = None

    def __enter__(self) -> Sync:
        if self.cfg.storage.url:  # the lease is taken already (claim)
            self._thread = threading.Thread(target=self._loop, name="rlcore-storage-sync", daemon=True)
            self._thread.start()
        return self

    def _loop(self) -> None:
        interval = float(self.cfg.storage.sync_interval_s or 0)
        last = time.monotonic()
        while not self._stop.wait(min(HEARTBEAT_S, interval) if interval > 0 else HEARTBEAT_S):
            try:
                if interval > 0 and time.monotonic() - last >= interval:
                    upload(self.cfg)
                    last = time.monotonic()
                else:
                    renew_lease(self.cfg)
            except Exception as exc:  # the store is away for now: say so, the next tick retries
                log.warning("uploading the run's files to %s failed (retried): %s", self.cfg.storage.url, exc)

    def __exit__(self, *exc) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join(timeout=HEARTBEAT_S)
        try:
            upload(self.cfg)
            release_lease(self.cfg)
        except Exception as err:
            self.failed = f"{type(err).__name__}: {err}"
            print(f"rlcore: error: the run's files were not uploaded to {self.cfg.storage.url} ({self.failed}); "
                  f"they are in {self.cfg.output_dir}", flush=True, file=sys.stderr)
