"""Incremental reading of a JSON-lines file that another process appends to.

The page of a long run must stay cheap: each poll reads only the bytes added since the last one
(from a kept byte offset) and parses only complete lines; a line still being written waits for
its newline. A file that was replaced or cut back (`resume=true` truncates the series) is read
again from its start, and the caller is told (`reset`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


class JsonlTail:
    """The rows of one JSON-lines file, read incrementally (`poll`)."""

    def __init__(self, path: Path):
        self.path = path
        self.offset = 0
        """Byte offset just past the last complete line read."""
        self._inode: int | None = None

    def poll(self) -> tuple[list[dict[str, Any]], bool]:
        """(the rows added since the last poll, reset): `reset` is True when the file was replaced
        or cut back since, in which case the rows are all of its rows again. A line that does not
        parse (a writer's torn write) is skipped; a missing file has no rows."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            reset = self.offset > 0
            self.offset, self._inode = 0, None
            return [], reset
        reset = self._inode is not None and (st.st_ino != self._inode or st.st_size < self.offset)
        if reset:
            self.offset = 0
        self._inode = st.st_ino
        if st.st_size == self.offset:
            return [], reset
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read(st.st_size - self.offset)
        end = data.rfind(b"\n")
        if end < 0:
            return [], reset
        self.offset += end + 1
        rows = []
        for line in data[:end].splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict):
                rows.append(row)
        return rows, reset
