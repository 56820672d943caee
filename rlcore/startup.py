"""Start-up progress: one console line per phase (Ray, placement, model loading, engines, first
sync), each timed, so the minute or more before the first step is not silent."""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager
from typing import Callable, Iterator, TextIO


class StartupPhases:
    """Times phases and prints `rlcore: LABEL ... 1.2s` (one line per phase; a `chatty` phase,
    one that logs lines of its own, gets a start line and an end line instead)."""

    def __init__(self, stream: TextIO | None = None, clock: Callable[[], float] = time.perf_counter):
        self.stream = stream
        self.clock = clock
        self.done: list[tuple[str, float]] = []
        """(label, seconds) of every phase that finished, in order."""

    def _write(self, text: str, end: str = "\n") -> None:
        stream = self.stream or sys.stdout
        stream.write(text + end)
        stream.flush()

    @contextmanager
    def phase(self, label: str, chatty: bool = False) -> Iterator[None]:
        self._write(f"rlcore: {label} ...", end="\n" if chatty else "")
        start = self.clock()
        try:
            yield
        except BaseException as exc:
            outcome = "interrupted" if isinstance(exc, KeyboardInterrupt) else "failed"
            self._write(f"rlcore: {label}: {outcome}" if chatty else f" {outcome}")
            raise
        seconds = self.clock() - start
        self.done.append((label, seconds))
        self._write(f"rlcore: {label}: done in {seconds:.1f}s" if chatty else f" {seconds:.1f}s")
