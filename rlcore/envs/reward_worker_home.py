"""The process state each reward call in a worker starts from, restored after every call."""

from __future__ import annotations

import os
import signal
import sys


class Home:
    """The process state every call starts from: working directory, environment, sys.path."""

    def __init__(self):
        self.cwd = os.getcwd()
        self.environ = dict(os.environ)
        self.raw_environ = dict(_raw(os.environ))
        self.path = list(sys.path)

    def restore(self) -> None:
        signal.alarm(0)  # an alarm a call set would kill a later call
        try:
            moved = os.getcwd() != self.cwd
        except OSError:  # its directory was removed
            moved = True
        if moved:
            os.chdir(self.cwd)
        if _raw(os.environ) != self.raw_environ:  # the encoded mapping: 1 us where decoding all is 80
            os.environ.clear()
            os.environ.update(self.environ)
        if sys.path != self.path:
            sys.path[:] = self.path


def _raw(environ) -> dict:
    return getattr(environ, "_data", environ)

