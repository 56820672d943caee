"""The run's timeline on disk: `OUTPUT_DIR/events.jsonl`, one JSON object per event, for the live
page (`python -m rlcore.watch`) to read.

Only what no other file holds is written here (the start, each start-up phase as it ends, an
interrupt, the end); the page reads restarts, evaluations and checkpoints from metrics.jsonl and
the checkpoint folders. A failed write is one warning, never a failed run.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("rlcore")
EVENTS_FILE = "events.jsonl"


class EventLog:
    """Appends `{"time", "kind", "text", ...}` lines to OUTPUT_DIR/events.jsonl."""

    def __init__(self, output_dir: Path | str):
        self.path = Path(output_dir) / EVENTS_FILE
        self._warned = False

    def write(self, kind: str, text: str, **fields: Any) -> None:
        """One event: `kind` (start, phase, interrupt, end, ...), a line for people, and fields
        such as `seconds` or `step`."""
        row = {"time": time.time(), "kind": kind, "text": text, **fields}
        try:
            with self.path.open("a") as f:
                f.write(json.dumps(row, sort_keys=True) + "\n")
        except OSError as exc:
            if not self._warned:
                self._warned = True
                log.warning("events.jsonl: %s (the live page's timeline misses events)", exc)

    def phase(self, label: str, seconds: float) -> None:
        """A start-up phase ended after `seconds` (`StartupPhases` listener)."""
        self.write("phase", label, seconds=round(seconds, 3))
