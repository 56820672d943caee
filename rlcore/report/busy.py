"""Wall-clock busy time of a component that serves overlapping calls (a threaded actor)."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager


class BusyClock:
    """Accumulates the time during which at least one call is active (the union of the calls'
    intervals), so concurrent calls are not double-counted."""

    def __init__(self):
        self._lock = threading.Lock()
        self._active = 0
        self._since = 0.0
        self._total = 0.0

    @contextmanager
    def busy(self):
        with self._lock:
            if self._active == 0:
                self._since = time.perf_counter()
            self._active += 1
        try:
            yield
        finally:
            with self._lock:
                self._active -= 1
                if self._active == 0:
                    self._total += time.perf_counter() - self._since

    def seconds(self) -> float:
        """Busy seconds so far, including a call still running."""
        with self._lock:
            running = time.perf_counter() - self._since if self._active else 0.0
            return self._total + running
