"""Committing a checkpoint or exported folder so that no reader ever sees it half-written or
half-deleted: on a filesystem, a temporary folder renamed in one `os.rename` (deleting renames
first); in an object store (no rename) the caller's marker object written last, and removed
first when the folder is deleted (`rlcore.storage.checkpoint`). Torch-free."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import uuid
from pathlib import Path

from rlcore.storage.checkpoint_dirs import META
from rlcore.storage.location import is_remote

log = logging.getLogger("rlcore")


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some filesystems do not support fsync on directories
        pass
    finally:
        os.close(fd)


def fsync_tree(path: Path) -> None:
    """Flush every file and directory under `path` to disk (before the commit rename)."""
    for dirpath, _, files in os.walk(path):
        for f in files:
            with open(os.path.join(dirpath, f), "rb") as fh:
                os.fsync(fh.fileno())
        _fsync_dir(Path(dirpath))


def temp_dir_for(final: Path) -> Path:
    return final.parent / f".tmp-{final.name}-{uuid.uuid4().hex[:8]}"


def commit_dir(tmp: Path, final: Path) -> Path:
    """Atomically make `tmp` visible as `final` (replacing an existing `final`)."""
    fsync_tree(tmp)
    old = None
    if final.exists():
        old = temp_dir_for(final)
        os.rename(final, old)
    os.rename(tmp, final)
    _fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return final


def remove_dir(path: Path) -> None:
    """Delete a committed directory so that no reader ever sees it half-deleted (in an object
    store: its meta.json first, which un-commits it)."""
    if is_remote(path):
        with contextlib.suppress(FileNotFoundError):
            (path / META).unlink()
        remove_tree(path)
        return
    doomed = temp_dir_for(path)
    os.rename(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def remove_tree(path) -> None:
    """Delete a folder or an object-store prefix, best effort."""
    if is_remote(path):
        try:
            path.fs.rm(path.path, recursive=True)
        except (OSError, ValueError) as exc:  # absent already, or the store refused: the next run retries
            log.warning("could not remove %s: %s", path, exc)
    else:
        shutil.rmtree(path, ignore_errors=True)
