"""Run untrusted environment code (reward functions, tool handlers) under a deadline.

Contract: :func:`call_many` never raises for the callee's faults. Each call gets an
:class:`Outcome` whose `error` says what went wrong (`timeout after Xs` or
`ExceptionType: message`), so the episode loop marks that sample and uses the others. What the
callee printed (stdout and stderr) is captured per call, truncated to `OUTPUT_LIMIT` characters,
and never reaches the process's own streams (the driver's console, Ray's log files).

Three isolation modes (``worker``, the default for scoring, is :mod:`rlcore.isolation.reward_workers`:
reused worker processes, killed at the deadline; the two below are this module's):

- ``thread``: the call runs in a fresh daemon thread. Cheap, and right for pure-Python
  scoring. Python cannot kill a thread: at the deadline the thread is abandoned and asked to stop
  (an asynchronous :class:`CallAbandoned` raised at its next bytecode, which ends sleep and busy
  loops in Python code but not a call blocked inside C). Abandoned threads still running are
  counted (:func:`threads_abandoned`); the environment moves to ``process`` (or fails its
  requests with one line) past a small bound, so hung rewards cannot pile up threads that starve
  the actor.
- ``process``: the call runs in a forked child in its own session; at the deadline the whole
  session is killed (SIGKILL), so a busy loop, a runaway C extension or a child it started costs
  the timeout and nothing after. The callee's return value must be picklable. Code *execution*
  (tests, user programs) goes through :mod:`rlcore.sandbox` instead, which is a security boundary.
"""

from __future__ import annotations

import ctypes
import io
import multiprocessing as mp
import os
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

OUTPUT_LIMIT = 4096
"""Characters of a call's stdout+stderr kept (the rest is counted, not kept)."""
STOP_GRACE_S = 0.05
"""How long a request waits, in all, for its timed-out threads to stop once asked."""
STUCK_AFTER_S = 5.0
"""A thread still running this long after it was asked to stop is stuck (blocked in C)."""
PR_SET_PDEATHSIG = 1
"""prctl(2): the signal a process gets when the thread that forked it ends."""


@dataclass
class Outcome:
    """What a guarded call produced: `value` when `error` is None; `output` is what it printed."""

    value: Any = None
    error: str | None = None
    output: str = ""

    @property
    def ok(self) -> bool:
        return self.error is None


class CallAbandoned(BaseException):
    """Raised inside a guarded thread that missed its deadline (a BaseException, so the callee's
    `except Exception` does not swallow it)."""


def _ask_to_stop(thread: threading.Thread) -> None:
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(CallAbandoned))


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def kill_session(proc) -> None:
    """SIGKILL a forked `multiprocessing` process and its whole session (anything it started),
    then reap it; one killed before its `setsid` (no group yet) is killed alone."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if proc.is_alive():
        proc.kill()
    proc.join(1.0)


class _Sink(io.TextIOBase):
    """Keeps the first `OUTPUT_LIMIT` characters written to it and counts the rest."""

    def __init__(self):
        self.parts: list[str] = []
        self.kept = self.dropped = 0

    def write(self, text: str) -> int:
        room = OUTPUT_LIMIT - self.kept
        if room > 0:
            self.parts.append(text[:room])
            self.kept += min(room, len(text))
        self.dropped += max(0, len(text) - max(room, 0))
        return len(text)

    def text(self) -> str:
        more = f"\n[... {self.dropped} more characters dropped]" if self.dropped else ""
        return "".join(self.parts) + more


class _ThreadRouter(io.TextIOBase):
    """Stands in for sys.stdout / sys.stderr: a thread running a guarded call writes to its own
    sink; every other thread writes to the original stream."""

    def __init__(self, original):
        self.original = original

    def _target(self):
        return getattr(_local, "sink", None) or self.original

    def write(self, text: str) -> int:
        return self._target().write(text)

    def flush(self) -> None:
        target = self._target()
        if target is self.original:
            target.flush()

    def __getattr__(self, name):  # fileno, encoding, isatty, buffer ... of the real stream
        return getattr(self.original, name)


_local = threading.local()
_router_lock = threading.Lock()
_abandoned: list[tuple[threading.Thread, float]] = []  # (thread, when it was asked to stop)


def _install_router() -> None:
    with _router_lock:
        if not isinstance(sys.stdout, _ThreadRouter):
            sys.stdout = _ThreadRouter(sys.stdout)
        if not isinstance(sys.stderr, _ThreadRouter):
            sys.stderr = _ThreadRouter(sys.stderr)


def threads_abandoned(older_than_s: float = 0.0) -> int:
    """Threads of guarded calls that missed their deadline and are still running (this process),
    counting only those asked to stop more than `older_than_s` seconds ago."""
    now = time.monotonic()
    with _router_lock:
        _abandoned[:] = [(t, at) for t, at in _abandoned if t.is_alive()]
        return sum(1 for _, at in _abandoned if now - at >= older_than_s)


class _ThreadCall:
    """A call running in a daemon thread; abandoned (not killed) if it misses its deadline."""

    def __init__(self, fn: Callable[..., Any], args: tuple):
        self._box: list[Outcome] = []
        self._sink = _Sink()
        self.abandoned = False
        self._thread = threading.Thread(target=self._run, args=(fn, args), name="rlcore-guarded-call", daemon=True)
        self._thread.start()

    def _run(self, fn, args) -> None:
        _local.sink = self._sink
        try:
            self._box.append(Outcome(value=fn(*args)))
        except BaseException as exc:  # user code: any failure is data, not a crash
            self._box.append(Outcome(error=_describe(exc)))

    def join(self, wait_s: float) -> None:
        self._thread.join(wait_s)

    def result(self, deadline: float, timeout_s: float) -> Outcome:
        self._thread.join(max(0.0, deadline - time.monotonic()))
        if self._thread.is_alive() or not self._box:
            self.abandoned = True
            _ask_to_stop(self._thread)
            with _router_lock:
                _abandoned.append((self._thread, time.monotonic()))
            return Outcome(error=f"timeout after {timeout_s:g}s", output=self._sink.text())
        out = self._box[0]
        out.output = self._sink.text()
        return out


def _child(conn, out_fd, fn, args, parent_pid: int) -> None:
    os.setsid()  # its own session: the deadline kills whatever it started too
    # a call must not outlive the rollout actor that made it (a killed actor runs no deadline)
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:
        os._exit(1)
    os.dup2(out_fd, 1)
    os.dup2(out_fd, 2)
    sys.stdout = sys.stderr = open(out_fd, "w", buffering=1, closefd=False)
    from rlcore.isolation.reward_reply import encode_reply

    try:
        out = Outcome(value=fn(*args))
    except BaseException as exc:
        out = Outcome(error=_describe(exc))
    try:  # data, never a pickle: the actor parses it (rlcore.isolation.reward_reply)
        conn.send_bytes(encode_reply(0, [out], 0, True, False))
    finally:
        conn.close()


class _ProcessCall:
    """A call running in a forked child; its session is killed with SIGKILL at the deadline."""

    def __init__(self, fn: Callable[..., Any], args: tuple):
        # fork: the callee (often a bound method of the environment) need not be importable by name
        ctx = mp.get_context("fork")
        self._out = tempfile.TemporaryFile()
        self._conn, child = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=_child, args=(child, self._out.fileno(), fn, args, os.getpid()), daemon=True)
        self._proc.start()
        child.close()

    def _output(self) -> str:
        self._out.seek(0)
        raw = self._out.read(OUTPUT_LIMIT + 1)
        self._out.seek(0, 2)
        extra = self._out.tell() - OUTPUT_LIMIT
        self._out.close()
        text = raw[:OUTPUT_LIMIT].decode(errors="replace")
        return text + (f"\n[... {extra} more bytes dropped]" if extra > 0 else "")

    def result(self, deadline: float, timeout_s: float) -> Outcome:
        from rlcore.isolation.reward_reply import BadReply, FrameReader, decode_reply

        reader = FrameReader()
        out = None
        try:
            # what is there, as it comes, until the deadline on this clock: half a frame waits no longer
            while out is None and self._conn.poll(max(0.0, deadline - time.monotonic())):
                data = os.read(self._conn.fileno(), 1 << 16)
                if not data:
                    self._proc.join(1.0)
                    out = Outcome(error=f"process died (exit code {self._proc.exitcode})")
                    break
                try:
                    frames = reader.feed(data)
                    if frames:
                        reply = decode_reply(frames[0])
                        if len(reply["outs"]) != 1:
                            raise BadReply("a reply without its one outcome")
                        out = reply["outs"][0]
                except BadReply as exc:
                    out = Outcome(error=f"reward process sent {exc}")
            if out is None:
                half = " (half a reply was on its pipe)" if reader.partial else ""
                out = Outcome(error=f"timeout after {timeout_s:g}s{half}")
        finally:
            kill_session(self._proc)
            self._conn.close()
        out.output = self._output()
        return out


def call_many(
    calls: list[tuple[Callable[..., Any], tuple]], timeout_s: float, isolation: str = "thread"
) -> list[Outcome]:
    """Run every ``fn(*args)`` of `calls` concurrently; each call gets `timeout_s` seconds from
    its start (<= 0: no deadline, run one after another in this thread). A call that misses its
    deadline fails alone: the others' outcomes are kept. Outcomes in call order."""
    _install_router()
    if timeout_s is None or timeout_s <= 0:
        outer = getattr(_local, "sink", None)  # a nested call: restored, and it gets the output too
        out = []
        for fn, args in calls:
            sink = _local.sink = _Sink()
            try:
                out.append(Outcome(value=fn(*args), output=""))
            except Exception as exc:
                out.append(Outcome(error=_describe(exc)))
            finally:
                _local.sink = outer
            out[-1].output = sink.text()
            if outer is not None:
                outer.write(out[-1].output)
        return out
    kind = _ProcessCall if isolation == "process" else _ThreadCall
    running = []
    for fn, args in calls:
        running.append((kind(fn, args), time.monotonic() + timeout_s))
    outcomes = [r.result(deadline, timeout_s) for r, deadline in running]
    stopping = [r for r, _ in running if isinstance(r, _ThreadCall) and r.abandoned]
    grace = time.monotonic() + STOP_GRACE_S  # threads asked to stop get a moment to do so
    for r in stopping:
        r.join(max(0.0, grace - time.monotonic()))
    outer = getattr(_local, "sink", None)
    if outer is not None:  # a nested call (a tool inside env_response): its output joins the caller's
        for o in outcomes:
            outer.write(o.output)
    return outcomes


def call_with_deadline(fn: Callable[..., Any], *args: Any, timeout_s: float, isolation: str = "thread") -> Outcome:
    """Call ``fn(*args)``; give up after `timeout_s` seconds (<= 0: no deadline, same thread)."""
    return call_many([(fn, args)], timeout_s, isolation)[0]
