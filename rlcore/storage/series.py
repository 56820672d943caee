"""The run's JSONL series (metrics.jsonl, samples.jsonl, data_order.jsonl, events.jsonl, a
profile's windows.jsonl) written so that no partial row is ever read back:

- a call's rows are serialised into one buffer and appended with one `write` (the rest of a short
  write follows at once); a write that fails part-way (a full disk) cuts the file back to where it
  was, so the file keeps whole rows only, and the failure is one :class:`StorageError` naming the
  file and its cause ("no space left on device");
- :func:`fsync_series` flushes them at a checkpoint, so a committed checkpoint's rows are on disk;
- :func:`read_rows` reads a series strictly: a line that does not parse is a truncated tail (a
  run killed mid-write by older code, a disk that filled), dropped, never kept as data.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any, Iterable

from rlcore.storage.errors import StorageError

_lock = threading.Lock()  # rows of one process go in one at a time (the cut-back needs it)


def encode_rows(rows: Iterable[dict[str, Any]], sort_keys: bool = True) -> bytes:
    """Rows as JSONL bytes, one line each (a row that does not serialise raises before any write)."""
    return "".join(json.dumps(r, sort_keys=sort_keys) + "\n" for r in rows).encode()


def _append(fd: int, data: bytes, path: Path) -> None:
    with _lock:
        start = os.fstat(fd).st_size
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(fd, view) :]
        except OSError as exc:
            try:
                os.ftruncate(fd, start)  # no half row stays behind
            except OSError:
                pass
            raise StorageError("writing", str(path), exc) from exc


def append_rows(path: Path | str, rows: Iterable[dict[str, Any]], sort_keys: bool = True) -> None:
    """Append `rows` to the series at `path` whole (one buffer, one write), or none of them:
    StorageError naming the file and the cause when the write fails."""
    data = encode_rows(rows, sort_keys)
    if not data:
        return
    path = Path(path)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    except OSError as exc:
        raise StorageError("opening", str(path), exc) from exc
    try:
        _append(fd, data, path)
    finally:
        os.close(fd)


class SeriesFile:
    """A series kept open for the life of a writer (metrics.jsonl): rows appended whole as by
    :func:`append_rows`; `reopen()` after the file was replaced (a resume's cut-back)."""

    def __init__(self, path: Path | str):
        self.path = Path(path)
        self._fd: int | None = None
        self.reopen()

    def reopen(self) -> None:
        self.close()
        try:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError as exc:
            raise StorageError("opening", str(self.path), exc) from exc

    @property
    def closed(self) -> bool:
        return self._fd is None

    def append(self, rows: Iterable[dict[str, Any]], sort_keys: bool = True) -> None:
        data = encode_rows(rows, sort_keys)
        if data:
            if self._fd is None:
                raise ValueError(f"{self.path} is closed")
            _append(self._fd, data, self.path)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def fsync_series(folder: Path | str, names: Iterable[str]) -> None:
    """Flush the series `names` of `folder` to disk (at a checkpoint); an absent file is skipped,
    a failure is StorageError naming the file."""
    for name in names:
        path = Path(folder) / name
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise StorageError("flushing", str(path), exc) from exc
        try:
            os.fsync(fd)
        except OSError as exc:
            raise StorageError("flushing", str(path), exc) from exc
        finally:
            os.close(fd)


def read_rows(path: Path | str) -> tuple[list[tuple[str, dict[str, Any]]], int]:
    """The rows of a series as (line, parsed object), and how many lines did not parse as a JSON
    object (dropped: a truncated row is never data). Empty lines are skipped. A missing file has
    no rows."""
    path = Path(path)
    if not path.is_file():
        return [], 0
    rows, broken = [], 0
    for line in path.read_bytes().decode("utf-8", errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            broken += 1
            continue
        if not isinstance(row, dict):
            broken += 1
            continue
        rows.append((line, row))
    return rows, broken
