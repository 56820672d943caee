"""A reward worker's progress fields, shared between the actor and the worker, and the lock that
orders their updates (:mod:`rlcore.isolation.reward_worker_loop` names the fields).

The fields live in a memfd both sides map, so the memory reaches a worker by file descriptor:
inherited when the actor forks the worker's keeper, passed over a socket when the pool's zygote
(:mod:`rlcore.isolation.reward_zygote`) does. The lock is a POSIX record lock on that memfd (it holds
between processes, however the descriptor got there) under a thread lock (record locks belong to a
process, so two threads of the actor would both hold one).
"""

from __future__ import annotations

import ctypes
import fcntl
import math
import mmap
import os
import threading
import time

FIELDS = 6
EXIT = 5
"""The field the zygote sets to the keeper's wait status once it reaped it (NaN while it lives)."""
POLL_S = 0.001


class Progress:
    """`progress[i]` reads and writes field i; `with progress:` (or `acquire(timeout)`) holds
    its lock. `Progress()` creates the memory; `Progress(fd)` maps one created elsewhere."""

    def __init__(self, fd: int | None = None):
        if fd is None:
            fd = os.memfd_create("rlcore-reward-progress", os.MFD_CLOEXEC)
            os.ftruncate(fd, 8 * FIELDS)
            fresh = True
        else:
            fresh = False
        self.fd = fd
        self._map = mmap.mmap(fd, 8 * FIELDS)
        self._values = (ctypes.c_double * FIELDS).from_buffer(self._map)
        self._threads = threading.Lock()
        self.closed = False
        if fresh:
            self._values[EXIT] = math.nan

    def __getitem__(self, i: int) -> float:
        return self._values[i]

    def __setitem__(self, i: int, value: float) -> None:
        self._values[i] = value

    def acquire(self, timeout: float | None = None) -> bool:
        """Hold the lock; False if it could not within `timeout` seconds (None: wait)."""
        if not self._threads.acquire(timeout=-1 if timeout is None else timeout):
            return False
        if timeout is None:
            fcntl.lockf(self.fd, fcntl.LOCK_EX)
            return True
        until = time.monotonic() + timeout
        while True:
            try:
                fcntl.lockf(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except OSError:
                if time.monotonic() >= until:
                    self._threads.release()
                    return False
                time.sleep(POLL_S)

    def release(self) -> None:
        fcntl.lockf(self.fd, fcntl.LOCK_UN)
        self._threads.release()

    def __enter__(self) -> "Progress":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def close(self) -> None:
        """Unmap it and close the descriptor (this side only)."""
        if not self.closed:
            self.closed = True
            del self._values
            self._map.close()
            os.close(self.fd)
