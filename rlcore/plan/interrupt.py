"""Ctrl-C and SIGTERM (what a scheduler sends before it kills a job) for a running job.

:class:`StopRequest` replaces the default handlers of SIGINT and SIGTERM while a run runs.
With `graceful` (the RL driver checks :attr:`StopRequest.requested` at each step boundary), the
first signal prints one line and lets the step in flight finish, then the driver saves a
checkpoint and stops; a second signal raises KeyboardInterrupt at once. Without it (drivers
that do not check), the first signal raises KeyboardInterrupt, SIGTERM included, so a SIGTERM
ends the run the way Ctrl-C does: one rlcore line, no C++ stack from Ray's fatal-signal
handler (install it after `ray.init`, which installs that handler).
"""

from __future__ import annotations

import os
import signal
import sys
import threading

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopRequest:
    def __init__(self, graceful: bool):
        """`graceful`: the first signal only sets `requested` (its owner stops at a boundary)."""
        self.graceful = graceful
        self.signal_name: str | None = None
        """Name of the first signal received (SIGINT, SIGTERM), None while none came."""
        self._previous: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        return self.signal_name is not None

    def install(self) -> "StopRequest":
        """Take over SIGINT and SIGTERM (main thread only; elsewhere it does nothing)."""
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def restore(self) -> None:
        """Put back the handlers `install` replaced."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self.requested or not self.graceful:
            self.signal_name = self.signal_name or name
            raise KeyboardInterrupt(name)
        self.signal_name = name
        print(
            f"rlcore: {name} received: stopping after the step in flight and saving a checkpoint there; "
            f"{stop_at_once_hint()}",
            file=sys.stderr,
            flush=True,
        )


RAY_JOB_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"
"""Set by Ray's job supervisor in a Ray Job's driver."""


def stop_at_once_hint(environ=os.environ) -> str:
    """How the run is stopped at once after a graceful stop was asked. In a Ray Job nobody can
    press Ctrl-C: Ray itself kills the job RAY_JOB_STOP_WAIT_TIME_S after its stop signal."""
    if RAY_JOB_ENV not in environ:
        return "press Ctrl-C again to stop at once (no checkpoint)"
    wait = environ.get("RAY_JOB_STOP_WAIT_TIME_S", "3")
    return (
        f"in a Ray Job, Ray kills it {wait} s after the stop (RAY_JOB_STOP_WAIT_TIME_S on the cluster: "
        "raise it to give the checkpoint time)"
    )
