"""The run's timeline on disk: `OUTPUT_DIR/events.jsonl`, one JSON object per event, for the live
page (`python -m rlcore.watch`) to read.

Only what no other file holds is written here (the start, each start-up phase as it ends, an
interrupt, the end, and the faults the run survived: a rollout actor that died or stopped
answering, rejoined, or was re-placed on another node, a trainer group restarted on the same or
other nodes); the page reads evaluations and checkpoints from metrics.jsonl and the checkpoint
folders. A failed write is one warning, never a failed run.

Fault events are the run's own warning lines: a component logs its line with
`extra=event(kind, ...)` and :meth:`EventLog.capture` (installed by `rlcore.run` around the run)
writes each such line here too, so the components need no handle on this file.
"""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path
from typing import Any, Iterator

from rlcore.storage.errors import StorageError
from rlcore.storage.series import append_rows

log = logging.getLogger("rlcore")
EVENTS_FILE = "events.jsonl"
EVENT_ATTR = "rlcore_event"
"""The log record attribute that makes a log line a timeline event too (:func:`event`)."""


def event(kind: str, **fields: Any) -> dict[str, Any]:
    """`log.warning(line, ..., extra=event("rollout_rejoined", actor=1, step=4))`: the line is
    also written to events.jsonl as `{"kind": kind, "text": line, **fields}` while a run
    captures them (:meth:`EventLog.capture`)."""
    return {EVENT_ATTR: {"kind": kind, **fields}}


class _EventHandler(logging.Handler):
    """Writes the log records that carry an event (:func:`event`) to an :class:`EventLog`."""

    def __init__(self, events: "EventLog"):
        super().__init__(logging.DEBUG)
        self.events = events

    def emit(self, record: logging.LogRecord) -> None:
        fields = getattr(record, EVENT_ATTR, None)
        if isinstance(fields, dict) and "kind" in fields:
            try:
                text = record.getMessage()
            except (TypeError, ValueError):
                text = str(record.msg)
            self.events.write(**{"text": text, **fields})


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
            append_rows(self.path, [row])  # whole or not at all (rlcore.storage.series)
        except (StorageError, TypeError, ValueError) as exc:
            if not self._warned:
                self._warned = True
                log.warning("events.jsonl: %s (the live page's timeline misses events)", exc)

    @contextlib.contextmanager
    def capture(self, logger: logging.Logger) -> Iterator[None]:
        """While inside, the lines `logger` (and its children) log with an :func:`event` are
        written here too."""
        handler = _EventHandler(self)
        logger.addHandler(handler)
        try:
            yield
        finally:
            logger.removeHandler(handler)

    def phase(self, label: str, seconds: float) -> None:
        """A start-up phase ended after `seconds` (`StartupPhases` listener)."""
        self.write("phase", label, seconds=round(seconds, 3))
