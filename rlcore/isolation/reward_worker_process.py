"""The actor's side of one reward worker process (:mod:`rlcore.isolation.reward_workers` schedules
calls over them; :mod:`rlcore.isolation.reward_worker_loop` is what runs in the process)."""

from __future__ import annotations

import array
import json
import multiprocessing as mp
import os
import pickle
import select
import signal
import socket
import threading
import time

from rlcore.isolation import reward_worker_walls as walls
from rlcore.isolation.reward_reply import BadReply, FrameReader, StaleReply, decode_reply
from rlcore.isolation.reward_worker_loop import (
    ABANDON_SIGNAL,
    CURRENT,
    CUT,
    EXIT_DESCENDANTS,
    EXIT_PIPE_LOST,
    FLUSH_SIGNAL,
    NAMESPACE,
    REAP_WINDOW_S,
    STARTED,
    keep,
)
from rlcore.isolation.reward_worker_ns import NONE
from rlcore.isolation.reward_worker_progress import Progress
from rlcore.isolation.reward_zygote import Zygote, signal_pidfd
from rlcore.isolation.safety import kill_session

LOCK_WAIT_S = 0.5
KEEPER_WAIT_S = 1.0
FORK_RETRY_S = 5.0
"""How long a worker's start retries a fork that another thread's fork refused."""
FORK_LOCK = threading.Lock()
"""One worker fork at a time in this process. On Python >= 3.12, filelock (>= 4) refuses an
`os.fork` while another thread of the process is inside one (its audit hook raises
RuntimeError), and a rollout actor starts workers from several request threads at once: a
refused fork failed every sample of the calls it was to run (27% of one GPU run's samples)."""


def start_forked(proc) -> None:
    """`proc.start()` (a fork-context Process), one at a time in this process; a fork refused
    while a thread outside this module forks (RuntimeError naming fork) is retried for up to
    :data:`FORK_RETRY_S`."""
    deadline = time.monotonic() + FORK_RETRY_S
    while True:
        with FORK_LOCK:
            # the keeper starts with SIGTERM blocked: until `keep` installs its own handler, a stop
            # would run the handler it inherited from this process (a run's graceful stop, say),
            # which leaves it running; blocked, the stop waits for `keep`'s handler
            mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
            try:
                proc.start()
                return
            except RuntimeError as e:
                if "fork" not in str(e) or time.monotonic() > deadline:
                    raise
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        time.sleep(0.01)


class Worker:
    """The actor's handle on one reward worker (its keeper process, pipe and progress)."""

    def __init__(self, owner, memory_mb: int, zygote: Zygote | None = None, network: bool = False, name: str = "env"):
        """The worker's keeper is forked by `zygote` (a lean process: :mod:`rlcore.isolation.reward_zygote`)
        or, without one, by this process (the environment need not be importable by name).
        `network`: the environment's `env.reward.network` (else the worker has none)."""
        ctx = mp.get_context("fork")
        self.conn, child = ctx.Pipe()
        self.name = name
        self.reader = FrameReader()
        self.pidfd: int | None = None
        """The worker's pidfd, from its keeper (the worker's parent, before the worker may write)."""
        self.namespace = -1
        self.pending: list[dict] = []
        """Replies read with the hello (`_signal`), not yet taken."""
        self.batch_id = 0
        self.seen = (-1, 0.0)
        """(call index, when this process first saw the worker on it): deadlines are on this clock."""
        self.progress = self.lock = Progress()
        self.progress[NAMESPACE] = -1
        self.from_actor = zygote is None
        """Forked from the actor (its zygote not ready yet, or none): every call's process copies the
        actor's page tables (torch, the engine), several ms more a call than a zygote worker's."""
        if zygote is not None:
            try:
                self.proc = zygote.start(os.dup(child.fileno()), self.progress, memory_mb, network)
            except BaseException:
                self.close()
                raise
            finally:
                child.close()
        else:
            walls.worker_filter(network)  # built once here, not in every worker
            # the process started here is the worker's keeper (its parent); the worker is its child
            self.proc = ctx.Process(
                target=keep,
                args=(child, owner, self.progress, self.lock, os.getpid(), memory_mb, network),
                daemon=True,
                name="rlcore-reward-worker",
            )
            start_forked(self.proc)
            child.close()
        self.idle_since = 0.0
        """When it last went back to its pool's idle workers (`time.monotonic`)."""

    def read_replies(self) -> list[dict]:
        """The replies complete after reading what the pipe holds now (call when it is readable:
        never blocks). EOFError when the worker is gone; BadReply (naming the environment) for a
        frame that is not a reply, or a reply that is not for the batch it runs."""
        fd = self.conn.fileno()
        if self.pidfd is None:
            data, fds = self._receive_hello(fd)
        else:
            data, fds = os.read(fd, 1 << 16), []
        if not data:
            raise EOFError
        try:
            frames = self.reader.feed(data)
            if self.pidfd is None:
                if not frames:  # the hello comes whole, before anything else
                    raise BadReply("the worker's first frame was not its keeper's")
                hello = json.loads(frames.pop(0))
                if len(fds) != 1 or not isinstance(hello, dict) or not isinstance(hello.get("hello"), int):
                    raise BadReply("the worker's first frame was not its keeper's")
                self.pidfd, self.namespace = fds.pop(), hello["hello"]
            replies = [decode_reply(f) for f in frames]
            for reply in replies:
                if reply["batch"] != self.batch_id:
                    raise (StaleReply if 0 < reply["batch"] < self.batch_id else BadReply)(
                        f"a reply for batch {reply['batch']} while it runs batch {self.batch_id}"
                    )
            return replies
        except StaleReply as exc:
            raise StaleReply(f"{self.name}: reward worker sent {exc}") from None
        except (BadReply, ValueError) as exc:
            raise BadReply(f"{self.name}: reward worker sent {exc}") from None
        finally:
            for extra in fds:
                os.close(extra)

    def _receive_hello(self, fd: int) -> tuple[bytes, list[int]]:
        sock = socket.socket(fileno=os.dup(fd))
        try:
            fds = array.array("i")
            data, ancdata, _, _ = sock.recvmsg(1 << 16, socket.CMSG_SPACE(4 * fds.itemsize))
            for level, kind, payload in ancdata:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
            return data, list(fds)
        finally:
            sock.close()

    def observe(self, batch_len: int, cut: int | None) -> tuple[int, float]:
        """(index of the call it runs, when this process first saw it there) for a running batch
        of `batch_len` calls (-1 before the first). The index is the worker's word, checked: it
        only moves forward, within the batch and the cut; the time is this process's own.
        BadReply when the worker broke that."""
        k, _ = self.where()
        seen_k, seen_at = self.seen
        if k == seen_k:
            return seen_k, seen_at
        if k < seen_k or k >= batch_len or (cut is not None and k > cut):
            raise BadReply(
                f"{self.name}: reward worker wrote call {k} into its progress (it ran {seen_k} "
                f"of {batch_len}{'' if cut is None else f', cut at {cut}'})"
            )
        self.seen = (k, time.monotonic())
        return self.seen

    @property
    def pid(self) -> int:
        """The keeper's pid (the process this one forked and reaps)."""
        return self.proc.pid

    def death(self) -> str:
        """How the worker ended, once its pipe closed (waits for its keeper to end what the call
        left, `REAP_WINDOW_S`, and 1 s more)."""
        wait_exit(self.proc, time.monotonic() + REAP_WINDOW_S + 1.0)
        code = self.proc.exitcode
        if code is not None and code < 0:  # the keeper itself was signalled: no one here sends that
            return (
                f"the reward signalled its process's parent (signal {-code}): the reward worker was lost, "
                "the rollout actor spared"
            )
        if code is not None and code >= 128:
            return f"reward worker killed by signal {code - 128}"
        if code == EXIT_PIPE_LOST:
            return "the reward closed its worker's pipe to the actor (file descriptors it did not open)"
        if code == EXIT_DESCENDANTS:
            return "the processes the reward started outran the reward worker's kill"
        if code is None:
            return f"reward worker lost (its keeper had not exited {REAP_WINDOW_S + 1.0:.0f} s after its pipe closed)"
        return f"reward worker exited (code {code})"

    def send(self, blobs: list[bytes]) -> float:
        """Start a batch; returns when it was sent."""
        now = time.monotonic()
        self.progress[CURRENT], self.progress[STARTED], self.progress[CUT] = -1, now, len(blobs) - 1
        self.batch_id += 1
        self.seen = (-1, now)
        self.conn.send_bytes(pickle.dumps((self.batch_id, blobs)))
        return now

    @property
    def shares_pid_namespace(self) -> bool:
        """Whether the worker could not get a PID namespace of its own (it can signal the actor)."""
        return self.namespace == NONE

    def where(self) -> tuple[int, float]:
        """(index of the call it runs, when that call started); -1 before the first."""
        got = self.lock.acquire(timeout=LOCK_WAIT_S)
        try:
            return int(self.progress[CURRENT]), self.progress[STARTED]
        finally:
            if got:
                self.lock.release()

    def cut(self) -> int | None:
        """Let the running call be its last; returns its index (None: none started yet, or the
        worker cannot be reached)."""
        if not self.lock.acquire(timeout=LOCK_WAIT_S):
            return None
        try:
            k = int(self.progress[CURRENT])
            if k < 0:
                return None
            self.progress[CUT] = k
            return k
        finally:
            self.lock.release()

    def abandon(self) -> None:
        """Ask the running call to stop (it raises CallAbandoned at its next bytecode)."""
        self._signal(ABANDON_SIGNAL)

    def flush(self) -> None:
        """Ask for the outcomes of the batch's calls finished so far (a reply that is not the
        batch's last, sent while the running call goes on)."""
        self._signal(FLUSH_SIGNAL)

    def _signal(self, signum: int) -> None:
        """Through the worker's pidfd alone (never a pid the worker could have written)."""
        if self.pidfd is None and self.conn.poll(0):
            try:
                self._take_hello()
            except (EOFError, OSError, BadReply):
                return
        signal_pidfd(self.pidfd, signum)  # none yet: its keeper has not said, so it runs no call

    def _take_hello(self) -> None:
        self.pending += self.read_replies()

    def quiet(self) -> bool:
        """Whether nothing more than its batch's replies came (a worker that wrote more is not reused)."""
        return not self.reader.partial and not self.pending and not self.conn.poll(0)

    def take_replies(self) -> list[dict]:
        """`read_replies`, after those read with the hello."""
        replies, self.pending = self.pending, []
        return replies + self.read_replies()

    def stop(self) -> None:
        """Ask the keeper to kill the worker and every process its calls left (any session) and
        exit; `reap` waits for it."""
        if self.proc.exitcode is None:
            if hasattr(self.proc, "send_signal"):  # forked by the zygote: through its pidfd
                self.proc.send_signal(signal.SIGTERM)
                return
            try:  # this process's own child, not yet reaped: its pid names it
                os.kill(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

    def reap(self, until: float) -> None:
        """Wait until `until` (time.monotonic) for the keeper to exit, then SIGKILL its session."""
        wait_exit(self.proc, until)
        if self.proc.exitcode is None:
            kill_session(self.proc)
        self.close()

    def close(self) -> None:
        """Release this side's pipe and progress memory (the worker is gone)."""
        self.conn.close()
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None
        proc = getattr(self, "proc", None)
        if proc is not None and not isinstance(proc, mp.process.BaseProcess):
            proc.close()  # a ZygoteChild's pidfd
        if self.progress is not None:
            self.progress.close()
            self.progress = self.lock = None

    def kill(self) -> None:
        self.stop()
        self.reap(time.monotonic() + KEEPER_WAIT_S)


def wait_exit(proc, until: float) -> None:
    """Wait until `proc` (a keeper) exited or `until` (time.monotonic) passed. Not
    `multiprocessing`'s `join(timeout)` for a keeper this process forked: the keeper closes every
    descriptor it inherited, the sentinel's too, so that join finds the sentinel closed at once and
    then waits in `waitpid` with no deadline (a keeper that ignored its stop hung a request for good)."""
    if not isinstance(proc, mp.process.BaseProcess):
        proc.join(max(0.0, until - time.monotonic()))  # a ZygoteChild: polls its exit status
        return
    if proc.exitcode is not None:
        return
    try:
        pidfd = os.pidfd_open(proc.pid)  # not yet reaped: the pid is still this child's
    except OSError:
        return
    try:
        select.select([pidfd], [], [], max(0.0, until - time.monotonic()))  # readable once it exited
    finally:
        os.close(pidfd)


def kill_all(workers: list[Worker]) -> None:
    """Kill `workers` together: each is asked to stop, then all are reaped under one deadline
    (their keepers exit in parallel)."""
    for worker in workers:
        worker.stop()
    until = time.monotonic() + KEEPER_WAIT_S
    for worker in workers:
        worker.reap(until)
