"""Run untrusted environment code (reward functions, tool handlers) under a deadline.

Contract: :func:`call_with_deadline` never raises for the callee's faults. It returns an
:class:`Outcome` whose `error` says what went wrong (`timeout after Xs` or
`ExceptionType: message`), so the episode loop can mark the sample and keep the run going.

Two isolation modes:

- ``thread`` (default): the call runs in a fresh daemon thread; on timeout it is abandoned,
  not killed (Python cannot kill a thread). Cheap, and right for pure-Python scoring. A daemon
  thread never blocks interpreter exit.
- ``process``: the call runs in a forked child that is killed (SIGKILL) on timeout, so even a
  runaway C extension stops. The callee's return value must be picklable. Code *execution*
  (tests, user programs) should go through :mod:`rlcore.sandbox` instead, which also limits
  CPU, memory and network.
"""

from __future__ import annotations

import multiprocessing as mp
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

ISOLATION = ("thread", "process")
ON_ERROR = ("fail", "zero")


@dataclass
class Outcome:
    """What a guarded call produced: `value` when `error` is None."""

    value: Any = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


class _ThreadCall:
    """A call running in a daemon thread; abandoned (not killed) if it misses its deadline."""

    def __init__(self, fn: Callable[..., Any], args: tuple):
        self._box: list[Outcome] = []
        self._thread = threading.Thread(target=self._run, args=(fn, args), name="rlcore-guarded-call",
                                        daemon=True)
        self._thread.start()

    def _run(self, fn, args) -> None:
        try:
            self._box.append(Outcome(value=fn(*args)))
        except BaseException as exc:  # user code: any failure is data, not a crash
            self._box.append(Outcome(error=_describe(exc)))

    def result(self, wait_s: float, timeout_s: float) -> Outcome:
        self._thread.join(max(0.0, wait_s))
        if self._thread.is_alive() or not self._box:
            return Outcome(error=f"timeout after {timeout_s:g}s")
        return self._box[0]


def _child(conn, fn, args) -> None:
    try:
        conn.send(Outcome(value=fn(*args)))
    except BaseException as exc:
        conn.send(Outcome(error=_describe(exc)))
    finally:
        conn.close()


class _ProcessCall:
    """A call running in a forked child; killed with SIGKILL if it misses its deadline."""

    def __init__(self, fn: Callable[..., Any], args: tuple):
        # fork: the callee (often a bound method of the environment) need not be importable by name
        ctx = mp.get_context("fork")
        self._conn, child = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=_child, args=(child, fn, args), daemon=True)
        self._proc.start()
        child.close()

    def result(self, wait_s: float, timeout_s: float) -> Outcome:
        try:
            if self._conn.poll(max(0.0, wait_s)):
                try:
                    return self._conn.recv()
                except EOFError:
                    self._proc.join(1.0)
                    return Outcome(error=f"process died (exit code {self._proc.exitcode})")
            return Outcome(error=f"timeout after {timeout_s:g}s")
        finally:
            if self._proc.is_alive():
                self._proc.kill()
            self._proc.join(1.0)
            self._conn.close()


def call_many(calls: list[tuple[Callable[..., Any], tuple]], timeout_s: float,
              isolation: str = "thread") -> list[Outcome]:
    """Run every ``fn(*args)`` of `calls` concurrently; each gets `timeout_s` seconds from now
    (<= 0: no deadline, run one after another in this thread). Outcomes in call order."""
    if timeout_s is None or timeout_s <= 0:
        out = []
        for fn, args in calls:
            try:
                out.append(Outcome(value=fn(*args)))
            except Exception as exc:
                out.append(Outcome(error=_describe(exc)))
        return out
    kind = _ProcessCall if isolation == "process" else _ThreadCall
    deadline = time.monotonic() + timeout_s
    running = [kind(fn, args) for fn, args in calls]
    return [r.result(deadline - time.monotonic(), timeout_s) for r in running]


def call_with_deadline(fn: Callable[..., Any], *args: Any, timeout_s: float,
                       isolation: str = "thread") -> Outcome:
    """Call ``fn(*args)``; give up after `timeout_s` seconds (<= 0: no deadline, same thread)."""
    return call_many([(fn, args)], timeout_s, isolation)[0]


def check_safety_args(reward_timeout_s: float, on_reward_error: str, reward_isolation: str) -> None:
    """Raise ValueError("env.args.KEY: ...") for a bad safety setting (see rlcore.validate)."""
    if reward_timeout_s is None or reward_timeout_s < 0:
        raise ValueError(f"env.args.reward_timeout_s: must be >= 0 (0 = no deadline), got {reward_timeout_s!r}")
    if on_reward_error not in ON_ERROR:
        raise ValueError(f"env.args.on_reward_error: choose one of {list(ON_ERROR)}, got {on_reward_error!r}")
    if reward_isolation not in ISOLATION:
        raise ValueError(f"env.args.reward_isolation: choose one of {list(ISOLATION)}, got {reward_isolation!r}")
