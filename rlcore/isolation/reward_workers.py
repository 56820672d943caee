"""Reward calls in reused worker processes (`env.reward.isolation: worker`, the default for scoring).

A :class:`WorkerPool` belongs to one environment; its workers start on first use (from the
pool's zygote, :mod:`rlcore.isolation.reward_zygote`, once it is ready) and are kept warm. Isolation
must cost a cheap reward what a thread costs, so a request's calls go out in batches: one message
per worker carries its share of the calls, one brings their outcomes back
(:mod:`rlcore.isolation.reward_worker_loop` is the worker's side). A worker runs its own copy of the
environment (as the zygote loaded it, or as it was when the worker was forked: scoring must not
depend on state that changes later).

Overrunning calls overlap instead of queueing: a call still running `HANDOFF_S` after it started
keeps its worker, the calls behind it in that worker's batch move to another worker (forked
when none is idle), and the outcomes its worker finished before it are sent on at once (they do
not wait for the overrun); at its deadline its worker's whole session is killed (SIGKILL). So a hang on
many tasks costs about one timeout per request, not one per hung call. `stream_many` hands each outcome
back as it settles, so the environment sends a group on as soon as its samples are scored
(`Environment.stream_groups`) and a hung call delays its own group only. Workers killed or lost
are replaced; the calls a lost worker had finished but not yet sent are run again.

Each call runs in a process of its own, forked from its warm worker (issue 54): what it changes
or starts dies with it, it cannot write another call's outcome, each worker's memory is bounded (`env.reward.memory_mb`), and each worker is
in a PID namespace of its own, where a reward cannot name the actor: see the worker's module.
Workers die with their parent. A call whose arguments do not pickle runs in a fork of
its own (`process` isolation), which inherits them. What a call prints from Python is kept on its
outcome (first `OUTPUT_LIMIT` characters); output written straight to file descriptors 1 and 2
is dropped.
"""

from __future__ import annotations

import logging
import math
import pickle
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from typing import Callable, Iterator

from rlcore.isolation.reward_reply import BadReply, StaleReply
from rlcore.isolation.reward_worker_process import KEEPER_WAIT_S, Worker, kill_all
from rlcore.isolation.reward_zygote import Zygote, ZygoteError, ZygoteHolder, ZygoteRefused
from rlcore.isolation.safety import Outcome, call_many

log = logging.getLogger("rlcore")

HANDOFF_S = 0.1
"""A call running this long hands the rest of its worker's batch to another worker."""
MIN_BATCH = 8
"""Calls per worker before a request spreads over more workers (fewer messages for cheap calls)."""
MAX_WORKERS = 256
"""Workers one pool may run at once, overrunning ones included (bounds the forks a hang storm
causes; past it, calls wait for a worker). A storm needs (hung calls per second) x (deadline):
30% of tasks hanging until a 2 s deadline at 0.7 s CPU steps of 16 x 8 samples is ~150; at 64,
calls queued for a worker and started their deadline late (issue 41: 19.6 RL s against 14.8)."""
MAX_IDLE = 128
"""Idle workers a pool keeps (a storm of hung calls needs many at once, again at every request)."""
KEEP_IDLE = 32
"""Idle workers kept however long they idle; those beyond it are killed after `IDLE_TTL_S` (an
idle worker holds ~3 MB of its own: a storm's workers need not outlive it)."""
IDLE_TTL_S = 60.0
ABANDON_GRACE_S = 0.5
"""How long a call asked to stop at its deadline has to do so before its worker is killed."""


@dataclass
class _Batch:
    worker: Worker
    items: list[int]
    """Call indices, in the order the worker runs them."""
    sent_at: float
    cut: int | None = None
    """Position of the last call it may run, once the rest moved elsewhere."""
    moved: list[int] = field(default_factory=list)
    abandoned_at: float | None = None
    """When its call at `cut` was asked to stop (it missed its deadline)."""
    flushed_for: int = -1
    """The overrunning call for which the worker was asked to send what it finished before it."""
    received: int = 0
    """Outcomes its replies brought so far (the next reply must start there)."""


class WorkerPool:
    def __init__(self, owner, size: int, memory_mb: int = 0, zygote: bool = True, network: bool = False):
        """Up to `size` workers per request (more while calls overrun), each running methods of
        `owner` (an environment) with `memory_mb` MiB of memory beyond what it was forked with
        (0: unbounded). `zygote`: start workers from a lean process (:mod:`rlcore.isolation.reward_zygote`)
        once it is ready, where `owner` pickles; else (and meanwhile) fork them from this process.
        `network`: the environment's `env.reward.network` (else its workers have none).
        Thread-safe: concurrent requests take workers of their own."""
        self.owner, self.size, self.memory_mb = owner, max(1, int(size)), int(memory_mb)
        self.network = bool(network)
        declared = str(getattr(owner, "name", "") or "")
        self.name = declared if declared not in ("", "env") else type(owner).__name__
        """How its errors name the environment."""
        self.zygotes = ZygoteHolder(owner, zygote)
        self.idle: list[Worker] = []
        self.dying: list[Worker] = []
        self.live = 0
        self._lock = threading.Lock()
        self.warned = False
        self.killed_pids: list[int] = []
        """Workers this pool ended before their time, so far: killed for overrunning a deadline, found
        dead, or (forks of the actor) let go once the zygote was ready."""

    def accepts(self, fn: Callable) -> bool:
        """Whether `fn` is a method of the owner (what a worker can run by name)."""
        return getattr(fn, "__self__", None) is self.owner and hasattr(self.owner, getattr(fn, "__name__", ""))

    def call_many(self, calls: list[tuple[Callable, tuple]], timeout_s: float) -> list[Outcome]:
        """Run every ``fn(*args)`` (methods of the owner) in the workers, each under `timeout_s`
        seconds from its start; outcomes in call order. Never raises for the callee's faults."""
        results: list[Outcome | None] = [None] * len(calls)
        for i, out in self.stream_many(calls, timeout_s):
            results[i] = out
        return results  # type: ignore[return-value]

    def stream_many(self, calls: list[tuple[Callable, tuple]], timeout_s: float) -> Iterator[tuple[int, Outcome]]:
        """`call_many`, as `(call index, outcome)` pairs in the order the calls settle: a call that
        overruns delays its own outcome only. Closing the iterator early kills what still runs."""
        results: list[Outcome | None] = [None] * len(calls)
        blobs: dict[int, bytes] = {}
        forked: list[int] = []
        for i, (fn, args) in enumerate(calls):
            try:
                blobs[i] = pickle.dumps((fn.__name__, args))
            except Exception:  # unpicklable arguments: a fork of this process inherits them instead
                forked.append(i)
        run = _Run(self, blobs, results, timeout_s)
        try:
            yield from run.until_done()
        finally:
            run.abandon()
            self.reap()
        yield from zip(forked, call_many([calls[i] for i in forked], timeout_s, "process") if forked else [])

    def take(self) -> Worker | None:
        """A live idle worker, or a new one; None when `MAX_WORKERS` run already. An idle fork of
        the actor is let go once the zygote is ready (see `give`)."""
        lean = self.zygote() is not None
        with self._lock:
            while self.idle:
                worker = self.idle.pop()
                alive = worker.proc.is_alive()
                if alive and not (lean and worker.from_actor):
                    return worker
                self.live -= 1
                self.killed_pids.append(worker.pid)
                if alive:  # asked to stop, not waited for under the lock: `reap` waits, as for `drop`
                    worker.stop()
                    self.dying.append(worker)
                else:
                    worker.kill()
            if self.live >= MAX_WORKERS:
                return None
            self.live += 1
        try:
            zygote = self.zygote()
            if zygote is not None:
                try:
                    return Worker(self.owner, self.memory_mb, zygote, self.network, self.name)
                except ZygoteRefused:
                    pass  # a fork from here says why, if it fails too
                except ZygoteError as e:
                    self.zygotes.lost(zygote, str(e))
            return Worker(self.owner, self.memory_mb, None, self.network, self.name)
        except BaseException:
            with self._lock:
                self.live -= 1
            raise

    def zygote(self) -> Zygote | None:
        """The pool's zygote once ready (`rlcore.isolation.reward_zygote.ZygoteHolder`); None: fork."""
        return self.zygotes.get()

    def give(self, worker: Worker) -> None:
        """Back to the idle workers (up to `MAX_IDLE`); a worker forked from the actor only while
        the pool has no zygote ready (once it has, a lean one from it replaces it)."""
        if worker.shares_pid_namespace and not self.warned:
            self.warned = True
            log.warning(
                "reward workers could not get a PID namespace of their own (unshare refused): a reward "
                "can signal the rollout actor and the run's other processes of its uid"
            )
        # a fork of the actor makes every call's process copy the actor's page tables (torch, an
        # engine): once the zygote is ready, a lean worker from it takes this one's place
        replaceable = worker.from_actor and self.zygote() is not None
        now = time.monotonic()
        expired: list[Worker] = []
        with self._lock:
            # the front idled longest (`take` pops the back)
            while len(self.idle) > max(KEEP_IDLE, 2 * self.size) and now - self.idle[0].idle_since > IDLE_TTL_S:
                expired.append(self.idle.pop(0))
                self.live -= 1
            keep = len(self.idle) < max(MAX_IDLE, 2 * self.size) and not replaceable
            if keep:
                worker.idle_since = now
                self.idle.append(worker)
            else:
                self.live -= 1
        kill_all(expired)
        if not keep:
            worker.kill()

    def drop(self, worker: Worker) -> None:
        """Kill `worker` without waiting (`reap` waits): overlapping deadlines kill in parallel."""
        worker.stop()
        with self._lock:
            self.live -= 1
            self.killed_pids.append(worker.pid)
            self.dying.append(worker)

    def reap(self) -> None:
        """Wait for the workers dropped so far to be gone (their keepers exit in parallel)."""
        with self._lock:
            dying, self.dying = self.dying, []
        until = time.monotonic() + KEEPER_WAIT_S
        for worker in dying:
            worker.reap(until)

    def close(self) -> None:
        """Stop every idle worker (busy ones belong to calls in progress)."""
        with self._lock:
            idle, self.idle = self.idle, []
            self.live -= len(idle)
        kill_all(idle)
        self.reap()
        self.zygotes.close()


class _Run:
    """One `call_many`: its calls' batches, the workers running them, their outcomes."""

    def __init__(self, pool: WorkerPool, blobs: dict[int, bytes], results: list, timeout_s: float):
        self.pool, self.blobs, self.results, self.timeout_s = pool, blobs, results, timeout_s
        self.todo = sorted(blobs)
        self.tries = {i: 0 for i in blobs}
        self.running: list[_Batch] = []
        self.handoff_s = min(HANDOFF_S, timeout_s / 2)
        self.suspects: set[int] = set()
        """Calls of a batch whose worker broke the protocol: each runs alone from then on, so a
        second break names the call that caused it, not the calls it shared a worker with."""
        self.settled: list[int] = []
        """Calls settled and not yet yielded (`take_settled`)."""

    def until_done(self) -> Iterator[tuple[int, Outcome]]:
        """Run the calls; yields each `(index, outcome)` as it settles."""
        while self.todo or self.running:
            yield from self.take_settled()
            self.start()
            if not self.running:  # no worker could be had: MAX_WORKERS overrun elsewhere
                time.sleep(self.handoff_s)
                continue
            pending = any(b.worker.pending for b in self.running)
            ready = wait([b.worker.conn for b in self.running], timeout=0 if pending else self.handoff_s / 2)
            ready = ready + [b.worker.conn for b in self.running if b.worker.pending]
            for batch in [b for b in self.running if b.worker.conn in ready]:
                self.finish(batch)
            now = time.monotonic()
            for batch in [b for b in self.running if b.worker.conn not in ready]:
                self.watch(batch, now)
        yield from self.take_settled()

    def take_settled(self) -> list[tuple[int, Outcome]]:
        """The outcomes settled since the last call."""
        out, self.settled = [(i, self.results[i]) for i in self.settled], []
        return out

    def start(self) -> None:
        """Hand the calls waiting to workers: at most `size` batches that nothing overruns."""
        slots = self.pool.size - sum(1 for b in self.running if b.cut is None)
        items, self.todo = self.todo, []
        self.dispatch(items, min(slots, len(items), max(1, math.ceil(len(items) / MIN_BATCH))))

    def dispatch(self, items: list[int], n: int) -> None:
        """Send `items` to `n` workers, in contiguous shares (what cannot be sent waits in todo)."""
        if n <= 0:
            self.todo.extend(items)
            return
        alone = [[i] for i in items if i in self.suspects]
        items = [i for i in items if i not in self.suspects]
        per = math.ceil(len(items) / n) if items else 1
        for share in alone + [items[j : j + per] for j in range(0, len(items), per)]:
            worker = self.pool.take()
            if worker is None:
                self.todo.extend(share)
                continue
            try:
                sent = worker.send([self.blobs[i] for i in share])
            except OSError:  # it died while idle (its parent thread ended): a fresh one next time
                self.pool.drop(worker)
                self.retry(share, "reward worker could not be reached")
                continue
            for i in share:
                self.tries[i] += 1
            self.running.append(_Batch(worker, share, sent))

    def finish(self, batch: _Batch) -> None:
        """A reply came (or its worker died): keep the outcomes; after the batch's last reply,
        requeue what it did not run. A reply that is not data of the expected shape (or not for
        the calls it may report) fails the call it came during, names the environment, and
        costs the worker; the batch's other calls run again elsewhere."""
        try:
            replies = batch.worker.take_replies()
            received = batch.received
            for reply in replies:
                received = self.check(batch, reply, received)
        except (EOFError, OSError):
            self.running.remove(batch)
            k = batch.worker.where()[0]  # the worker's word, but only about calls of its own batch
            if not batch.received <= k < len(batch.items):
                k = batch.worker.seen[0]
            why = batch.worker.death()
            self.pool.drop(batch.worker)
            if k >= 0:
                self.settle(batch.items[k], Outcome(error=f"{why} during this call"))
            self.requeue([i for p, i in enumerate(batch.items) if p != k and i not in batch.moved])
            return
        except StaleReply:  # written by a call of an earlier batch: this batch's calls run again elsewhere
            self.running.remove(batch)
            self.pool.drop(batch.worker)
            self.requeue([i for i in batch.items if i not in batch.moved])
            return
        except BadReply as exc:
            self.fail_worker(batch, str(exc))
            return
        for reply in replies:
            start, outs = reply["start"], reply["outs"]
            for i, out in zip(batch.items[start:], outs):
                self.settle(i, out)
            batch.received = start + len(outs)
            if not reply["final"]:  # what it finished before an overrunning call (`flush`)
                continue
            self.running.remove(batch)
            if reply["retire"] or reply is not replies[-1] or not batch.worker.quiet():
                self.pool.drop(batch.worker)
            else:
                self.pool.give(batch.worker)
            self.todo.extend(i for i in batch.items[batch.received :] if i not in batch.moved)
            return

    def check(self, batch: _Batch, reply: dict, received: int) -> int:
        """BadReply unless `reply` brings the next outcomes of `batch` (`received` so far), within
        its cut; the outcomes received after it."""
        last = len(batch.items) if batch.cut is None else batch.cut + 1
        if reply["start"] != received or reply["start"] + len(reply["outs"]) > last:
            raise BadReply(
                f"{self.pool.name}: reward worker sent outcomes {reply['start']}.."
                f"{reply['start'] + len(reply['outs']) - 1} where {received}..{last - 1} were due"
            )
        return received + len(reply["outs"])

    def fail_worker(self, batch: _Batch, why: str) -> None:
        """The worker broke the protocol (`why`) and is killed. A batch of one call: that call
        fails with `why`. Otherwise which call did it is unknown (what a call writes may be
        read while a later one runs): its unsettled calls run again, each alone."""
        if batch in self.running:
            self.running.remove(batch)
        self.pool.drop(batch.worker)
        left = [i for i in batch.items if i not in batch.moved and self.results[i] is None]
        if len(batch.items) == 1 or all(i in self.suspects for i in left):
            for i in left:
                self.settle(i, Outcome(error=why))
            return
        self.suspects.update(left)
        self.requeue(left)

    def watch(self, batch: _Batch, now: float) -> None:
        """At its call's deadline ask the call to stop, and kill its worker if it does not within
        `ABANDON_GRACE_S`; move the rest of its batch away from an overrun."""
        if batch.abandoned_at is not None:
            if now - batch.abandoned_at >= ABANDON_GRACE_S:
                self.kill(batch, batch.cut)
            return
        try:  # the call it is on is the worker's word (checked); when it started is this clock's
            k, started = batch.worker.observe(len(batch.items), batch.cut)
        except BadReply as exc:
            self.fail_worker(batch, str(exc))
            return
        if now - batch.sent_at >= self.timeout_s * len(batch.items) + ABANDON_GRACE_S:
            self.kill(batch, max(k, 0))  # however its progress reads, no batch outlives its calls' deadlines
            return
        if now - started >= self.timeout_s:
            cut = batch.cut if batch.cut is not None else batch.worker.cut()
            if cut is None:  # it never started its batch, or cannot be reached
                self.kill(batch, max(k, 0))
            elif cut == k:
                self.settle(batch.items[k], Outcome(error=f"timeout after {self.timeout_s:g}s"))
                self.move_rest(batch, cut)
                batch.worker.abandon()
                batch.abandoned_at = now
            else:  # it finished that call just now: the one it runs is on time
                self.move_rest(batch, cut)
        elif k >= 0 and now - started >= self.handoff_s:
            if batch.cut is None and k < len(batch.items) - 1:
                cut = batch.worker.cut()
                if cut is not None:
                    self.move_rest(batch, cut)
            if batch.flushed_for != k and any(self.results[i] is None for i in batch.items[:k]):
                batch.flushed_for = k
                batch.worker.flush()

    def move_rest(self, batch: _Batch, cut: int) -> None:
        if batch.cut is not None:
            return
        batch.cut, batch.moved = cut, batch.items[cut + 1 :]
        # where one call overran, the next may too: the rest spreads over `size` workers at once,
        # so consecutive hung calls start side by side, not one handoff apart
        if batch.moved:
            self.dispatch(batch.moved, min(self.pool.size, len(batch.moved)))

    def kill(self, batch: _Batch, k: int) -> None:
        """Kill its worker: call `k` timed out; the calls it finished are run again (their
        outcomes were in the lost reply)."""
        self.running.remove(batch)
        self.pool.drop(batch.worker)
        half = " (half a reply was on its pipe)" if batch.worker.reader.partial else ""
        self.settle(batch.items[k], Outcome(error=f"timeout after {self.timeout_s:g}s{half}"))
        self.requeue([i for p, i in enumerate(batch.items) if p != k and i not in batch.moved])

    def settle(self, i: int, out: Outcome) -> None:
        if self.results[i] is None:  # a call run twice (moved as it finished) keeps its first outcome
            self.results[i] = out
            self.settled.append(i)

    def requeue(self, items: list[int]) -> None:
        """Run again calls lost with a worker that another call killed (each such loss settles
        that call, so this ends)."""
        self.todo[:0] = [i for i in items if self.results[i] is None]

    def retry(self, items: list[int], why: str) -> None:
        for i in items:
            if self.results[i] is not None:
                continue
            if self.tries[i] >= 2:
                self.settle(i, Outcome(error=why))
            else:
                self.todo.append(i)

    def abandon(self) -> None:
        """Kill what still runs (only when this run itself failed)."""
        for batch in self.running:
            self.pool.drop(batch.worker)
        self.running = []
