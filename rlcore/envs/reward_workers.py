"""Reward calls in worker processes that are killed when a call overruns (`reward_isolation:
worker`, the default for scoring).

A :class:`WorkerPool` belongs to one environment. Its workers are forked from the process that
scores (the rollout actor) on first use, each in its own session, and serve calls one at a time
over a pipe: the parent sends a method name of the environment and the call's arguments
(pickled), the worker runs it on its own copy of the environment (as it was when the worker was
forked: scoring must not depend on state that changes later) and sends back an
:class:`~rlcore.envs.safety.Outcome`. A call that misses its deadline has its worker's whole
session killed (SIGKILL) and the worker replaced on the next call, so a busy loop, a runaway C
extension or a child it started costs the timeout and nothing after, and never shares the
actor's interpreter (no GIL taken from the engine). Workers die with their parent
(PR_SET_PDEATHSIG). A call whose arguments do not pickle runs in a fork of its own (`process`
isolation), which inherits them. What a call prints from Python is kept on its outcome (first
`OUTPUT_LIMIT` characters); output written straight to file descriptors 1 and 2 is dropped.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import signal
import sys
import time
from multiprocessing.connection import wait
from typing import Any, Callable

from rlcore.envs.safety import Outcome, _describe, _Sink, call_many, kill_session

PR_SET_PDEATHSIG = 1


def _serve(conn, owner: Any) -> None:
    os.setsid()  # its own session: a kill takes whatever the call started too
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass  # not Linux: the parent still kills workers at close and at every overrun
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    while True:
        try:
            name, args = conn.recv()
        except (EOFError, OSError):
            os._exit(0)
        sink = _Sink()
        sys.stdout = sys.stderr = sink
        try:
            out = Outcome(value=getattr(owner, name)(*args))
        except BaseException as exc:  # user code: any failure is data
            out = Outcome(error=_describe(exc))
        out.output = sink.text()
        try:
            conn.send(out)
        except Exception as exc:  # an unpicklable value
            conn.send(Outcome(error=f"reward value cannot be sent back: {_describe(exc)}", output=out.output))


class _Worker:
    def __init__(self, owner: Any):
        ctx = mp.get_context("fork")  # the environment need not be importable by name
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, owner), daemon=True, name="rlcore-reward-worker")
        self.proc.start()
        child.close()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def kill(self) -> None:
        kill_session(self.proc)  # the worker and anything it started
        self.conn.close()


class WorkerPool:
    def __init__(self, owner: Any, size: int):
        """Up to `size` workers, each running methods of `owner` (an environment)."""
        self.owner, self.size = owner, max(1, int(size))
        self.idle: list[_Worker] = []
        self.killed_pids: list[int] = []
        """Workers killed for overrunning their deadline (or found dead), so far."""

    def accepts(self, fn: Callable) -> bool:
        """Whether `fn` is a method of the owner (what a worker can run by name)."""
        return getattr(fn, "__self__", None) is self.owner and hasattr(self.owner, getattr(fn, "__name__", ""))

    def call_many(self, calls: list[tuple[Callable, tuple]], timeout_s: float) -> list[Outcome]:
        """Run every ``fn(*args)`` (methods of the owner) in the workers, each under `timeout_s`
        seconds from its start; outcomes in call order. Never raises for the callee's faults."""
        queue = list(enumerate(calls))
        results: list[Outcome | None] = [None] * len(calls)
        busy: dict[_Worker, tuple[int, float]] = {}
        forked: list[int] = []
        while queue or busy:
            while queue and len(busy) < self.size:
                i, (fn, args) = queue.pop(0)
                worker, reused = self._idle_worker()
                try:
                    worker.conn.send((fn.__name__, args))
                except OSError as exc:  # it died while idle (PR_SET_PDEATHSIG: the thread that forked it ended)
                    worker.kill()
                    if reused:
                        queue.insert(0, (i, (fn, args)))
                    else:
                        results[i] = Outcome(error=f"reward worker did not start: {_describe(exc)}")
                    continue
                except Exception:  # unpicklable arguments: a fork of this process inherits them instead
                    forked.append(i)
                    self.idle.append(worker)
                    continue
                busy[worker] = (i, time.monotonic() + timeout_s)
            if not busy:
                break
            left = max(0.0, min(d for _, d in busy.values()) - time.monotonic())
            ready = set(wait([w.conn for w in busy], timeout=left))
            for worker in [w for w in busy if w.conn in ready]:
                i, _ = busy.pop(worker)
                try:
                    results[i] = worker.conn.recv()
                    self.idle.append(worker)
                except (EOFError, OSError):
                    worker.proc.join(1.0)
                    results[i] = Outcome(error=f"reward worker died (exit code {worker.proc.exitcode})")
                    self._drop(worker)
            now = time.monotonic()
            for worker in [w for w, (_, d) in busy.items() if now >= d]:
                i, _ = busy.pop(worker)
                results[i] = Outcome(error=f"timeout after {timeout_s:g}s")
                self._drop(worker)
        for i, out in zip(forked, call_many([calls[i] for i in forked], timeout_s, "process") if forked else []):
            results[i] = out
        return results

    def _idle_worker(self) -> tuple[_Worker, bool]:
        """A live idle worker (True) or a new one (False)."""
        while self.idle:
            worker = self.idle.pop()
            if worker.proc.is_alive():
                return worker, True
            worker.kill()
        return _Worker(self.owner), False

    def _drop(self, worker: _Worker) -> None:
        worker.kill()
        self.killed_pids.append(worker.pid)

    def close(self) -> None:
        """Stop every idle worker (busy ones do not exist between calls)."""
        for worker in self.idle:
            worker.kill()
        self.idle = []
