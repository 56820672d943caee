"""Start-up progress: one console line per phase (Ray, placement, model loading, engines, first
sync), each timed, so the minute or more before the first step is not silent.

Phases that run at once are told apart: a phase in the foreground is `phase` (one line, or a
start and an end line when it is `chatty`); one that runs meanwhile in other processes (the
engines compiling while the trainer loads) is `background`, whose start and end lines say "(in
the background)". Their seconds overlap, so the start-up figure is not their sum but the wall
time from the process's start to step 1 (`process_age`).
"""

from __future__ import annotations

import os
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
        self.listener: Callable[[str, float], None] | None = None
        """Told (label, seconds) of each phase as it finishes (the run's events.jsonl)."""

    def _finished(self, label: str, seconds: float) -> None:
        self.done.append((label, seconds))
        if self.listener is not None:
            self.listener(label, seconds)

    def _write(self, text: str, end: str = "\n") -> None:
        stream = self.stream or sys.stdout
        stream.write(text + end)
        stream.flush()

    def background(self, label: str) -> "Background":
        """A phase that runs while the next ones do: prints `rlcore: LABEL (in the background) ...`
        now; its `finish()` prints the end line and records it (in finishing order)."""
        self._write(f"rlcore: {label} (in the background) ...")
        return Background(self, label, self.clock())

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
        self._finished(label, seconds)
        self._write(f"rlcore: {label}: done in {seconds:.1f}s" if chatty else f" {seconds:.1f}s")


class Background:
    """A background phase of `StartupPhases` (see `StartupPhases.background`)."""

    def __init__(self, phases: StartupPhases, label: str, start: float):
        self.phases, self.label, self.start = phases, label, start
        self.seconds: float | None = None

    def finish(self, waited_s: float = 0.0) -> float:
        """The phase ended (idempotent): `rlcore: LABEL: ready after 57.0s (in the background;
        1.2s waited for)`; `waited_s` is how long the foreground blocked on it at the end."""
        if self.seconds is None:
            self.seconds = self.phases.clock() - self.start
            self.phases._finished(f"{self.label} (in the background)", self.seconds)
            self.phases._write(
                f"rlcore: {self.label}: ready after {self.seconds:.1f}s (in the background; {waited_s:.1f}s waited for)"
            )
        return self.seconds

    def failed(self) -> None:
        if self.seconds is None:
            self.seconds = -1.0
            self.phases._write(f"rlcore: {self.label} (in the background): failed")


def process_age() -> float:
    """Seconds since this process started (Linux: its start time in /proc, ~10 ms precise;
    elsewhere: since this module was imported, which misses the interpreter's start)."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: start time in ticks since boot
        return time.clock_gettime(time.CLOCK_BOOTTIME) - started
    except (OSError, ValueError, IndexError, AttributeError):
        return time.monotonic() - _IMPORTED


_IMPORTED = time.monotonic()
