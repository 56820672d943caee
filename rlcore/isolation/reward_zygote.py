"""The pool's zygote: a lean process that starts reward workers, so starting one does not cost the
rollout actor a fork of itself.

Over 400 lines: the zygote's protocol, its keepers and their pidfds are one process's code.

A fork costs in proportion to the memory the forking process has mapped: ~14 ms in a process that
imported torch (0.4 ms in a bare interpreter), twice per worker (the keeper, then the worker), on
the actor's CPU with its GIL held. A storm of overrunning rewards needs a worker per overrunning
call (hundreds), so on the 2-core CPU box the storm's forks took the trainer's CPU for its first
steps (issue 41's hang case). The zygote is a fresh interpreter (:func:`main`) that imports what
the environment needs and unpickles it once; the keepers are its forks, so they and their workers
run the same environment as before, as it was when the pool started (with the modules its
`reward_imports` names imported too).

Protocol, over one Unix socket: the actor sends `(sys.path, environment pickle, its pid)`; the
zygote answers `("ready", pid)` or `("error", text)`. Then for each worker the actor sends
`("start", memory_mb)` and two descriptors (the worker's end of its pipe, its progress memfd);
the zygote forks a keeper (:func:`rlcore.isolation.reward_worker_loop.keep`) and answers its pid. The
zygote reaps its keepers and writes each one's wait status into its progress (`EXIT`), which is
how the actor learns that a keeper ended and how (:class:`ZygoteChild`). The zygote is killed the
moment the actor dies (PR_SET_PDEATHSIG; it fires when the *thread* that started the process
ends, so one long-lived thread starts every zygote), ends when the actor process ends (a pidfd
on it, in case) or its socket closes (the pool was dropped), and its keepers die with it (theirs
too). It stays in the actor's process group (a kill of the group reaches it) and ignores SIGINT
(Ctrl-C stops a run in its own time, scoring meanwhile).

An environment that does not pickle by reference (a class defined in `__main__` or inside a
function, a lock or socket among its fields) cannot cross to a fresh interpreter: its pool forks
workers from the actor, as before (:class:`rlcore.isolation.reward_workers.WorkerPool`).
"""

from __future__ import annotations

import importlib
import logging
import math
import os
import pickle
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from multiprocessing.reduction import recvfds, sendfds

from rlcore.isolation.reward_worker_progress import EXIT, Progress

log = logging.getLogger("rlcore")
_SPAWNER = ThreadPoolExecutor(1, thread_name_prefix="rlcore-zygote-spawner")
"""Starts the zygotes: its one thread lives as long as the process, so the zygote's
PR_SET_PDEATHSIG (which fires when the *thread* that started it ends) fires when the actor dies."""
START_TIMEOUT_S = 60.0
"""How long the zygote may take to import the environment and answer (a heavy import is slow)."""
REPLY_TIMEOUT_S = 10.0
"""How long a worker's start may wait for the zygote's answer."""


def signal_pidfd(pidfd: int | None, signum: int) -> None:
    """Signal the process `pidfd` holds (nothing when there is none yet or it has ended): how the
    actor signals a keeper or a worker, never by a pid read from memory a worker writes."""
    if pidfd is None:
        return
    try:
        signal.pidfd_send_signal(pidfd, signum)
    except OSError:  # ProcessLookupError included: it ended
        pass


class ZygoteError(RuntimeError):
    """The zygote could not start, or stopped answering."""


class ZygoteRefused(ZygoteError):
    """The zygote could not start this one worker (its fork failed); it serves on."""


class Zygote:
    """The actor's handle on a pool's zygote."""

    def __init__(self, owner):
        """Start the zygote for `owner` (returns at once; `ready` waits). Raises
        pickle.PicklingError (or another pickling error) when `owner` does not pickle."""
        blob = pickle.dumps(owner)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock, self.conn = ours, Connection(os.dup(ours.fileno()))
        try:
            self.proc = _SPAWNER.submit(
                subprocess.Popen,
                [
                    sys.executable,
                    "-c",
                    "import sys; from rlcore.isolation.reward_zygote import main; main(*sys.argv[1:])",
                    str(theirs.fileno()),
                    str(os.getpid()),
                ],
                pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                cwd=os.getcwd(),
                # rlcore imports there as here, before it is sent this process's sys.path
                env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)},
            ).result()
        finally:
            theirs.close()
        self.conn.send((list(sys.path), blob, os.getpid()))
        self.pid = self.proc.pid
        self._lock = threading.Lock()
        self._state: str | None = None  # "ready" | error text, once answered
        self.was_ready = False
        """Whether it ever answered that it was ready (one that never did failed to load)."""
        self.started_at = time.monotonic()

    def ready(self, wait_s: float = 0.0) -> bool:
        """Whether it answered that it is ready (waits up to `wait_s` for the answer). Raises
        ZygoteError if it answered with an error, died, or took past `START_TIMEOUT_S`."""
        with self._lock:
            if self._state is None:
                if self.conn.poll(wait_s):
                    try:
                        kind, detail = self.conn.recv()
                    except (EOFError, OSError):
                        kind, detail = "error", "exited before it was ready (its error is in this process's stderr)"
                    self._state = "ready" if kind == "ready" else str(detail)
                    self.was_ready = kind == "ready"
                elif time.monotonic() - self.started_at > START_TIMEOUT_S:
                    self._state = f"did not answer within {START_TIMEOUT_S:g}s"
                else:
                    return False
            if self._state != "ready":
                raise ZygoteError(f"reward worker zygote: {self._state}")
            return True

    def start(self, conn_fd: int, progress: Progress, memory_mb: int, network: bool = False) -> "ZygoteChild":
        """Fork a keeper for a worker whose pipe end is `conn_fd` (closed here once sent)."""
        with self._lock:
            if self.proc.poll() is not None:
                raise ZygoteError(f"reward worker zygote exited (code {self.proc.returncode})")
            try:
                self.conn.send(("start", int(memory_mb), bool(network)))
                sendfds(self.sock, [conn_fd, progress.fd])
                if not self.conn.poll(REPLY_TIMEOUT_S):
                    raise ZygoteError(f"reward worker zygote did not answer within {REPLY_TIMEOUT_S:g}s")
                kind, detail = self.conn.recv()
            except (EOFError, OSError) as e:
                raise ZygoteError(f"reward worker zygote lost: {e}") from e
            finally:
                os.close(conn_fd)
            if kind == "refused":
                raise ZygoteRefused(f"reward worker zygote: {detail}")
            if kind != "started":
                raise ZygoteError(f"reward worker zygote: {detail}")
            try:
                (pidfd,) = recvfds(self.sock, 1)
            except (EOFError, OSError, ValueError, RuntimeError) as e:
                raise ZygoteError(f"reward worker zygote sent no pidfd: {e}") from e
            return ZygoteChild(int(detail), progress, self, pidfd)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        """Stop it (its keepers die with it: they are asked to end their workers first)."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(2.0)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(2.0)
        self.conn.close()
        self.sock.close()


STARTS = 3
"""Zygotes one pool starts (a first, new ones when one dies) before its workers are only forks."""


class ZygoteHolder:
    """A pool's zygote: started on first use, replaced when it dies (`STARTS` in all), given up
    for good when it could not load the environment. Thread-safe."""

    def __init__(self, owner, enabled: bool = True):
        self.owner = owner
        self.starts = 0 if enabled else STARTS
        self._zygote: Zygote | None = None
        self._lock = threading.Lock()

    def get(self) -> Zygote | None:
        """The zygote once ready; None while it starts and where none can be had (workers are
        then forks of the actor)."""
        with self._lock:
            zygote = self._zygote
            if zygote is None:
                if self.starts >= STARTS:
                    return None
                self.starts += 1
                try:
                    zygote = self._zygote = Zygote(self.owner)
                except Exception as e:  # mostly: the environment does not pickle. Workers are forks of the actor
                    self.starts = STARTS
                    log.info(
                        "reward workers of %s start as forks of the rollout actor (no zygote: %s: %s)",
                        type(self.owner).__name__,
                        type(e).__name__,
                        e,
                    )
                    return None
        try:
            return zygote if zygote.ready() else None
        except ZygoteError as e:
            self.lost(zygote, str(e))
            return None

    def lost(self, zygote: Zygote, why: str) -> None:
        """`zygote` failed (`why`): closed, and replaced on the next `get` while starts are left."""
        with self._lock:
            if self._zygote is zygote:
                self._zygote = None
                if not zygote.was_ready:  # it could not load the environment: a new one would not either
                    self.starts = STARTS
                more = self.starts < STARTS
                # one that never loaded the environment is a fallback, not a fault (a class in __main__)
                log.log(
                    logging.WARNING if zygote.was_ready else logging.INFO,
                    "%s; reward workers %s",
                    why,
                    "start from a new zygote" if more else "start as forks of the rollout actor from now on",
                )
        zygote.close()

    def close(self) -> None:
        with self._lock:
            zygote, self._zygote = self._zygote, None
        if zygote is not None:
            zygote.close()


class ZygoteChild:
    """A keeper the zygote forked, with what the actor needs of a `multiprocessing.Process`:
    `pid`, `is_alive`, `exitcode` (negative: killed by that signal), `join`, `kill`."""

    def __init__(self, pid: int, progress: Progress, zygote: Zygote, pidfd: int):
        self.pid, self.progress, self.zygote, self.pidfd = pid, progress, zygote, pidfd
        self._code: int | None = None

    @property
    def exitcode(self) -> int | None:
        if self._code is None:
            status = math.nan if self.progress.closed else self.progress[EXIT]
            if not math.isnan(status):
                self._code = os.waitstatus_to_exitcode(int(status))
            elif self.progress.closed or not self.zygote.alive():  # it died with its zygote
                self._code = -signal.SIGKILL
        return self._code

    def is_alive(self) -> bool:
        return self.exitcode is None

    def join(self, timeout: float | None = None) -> None:
        until = None if timeout is None else time.monotonic() + timeout
        while self.exitcode is None and (until is None or time.monotonic() < until):
            time.sleep(0.002)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def send_signal(self, signum: int) -> None:
        """Through the keeper's pidfd (from the zygote, which forked it)."""
        signal_pidfd(self.pidfd, signum)

    def close(self) -> None:
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None


def serve(sock: socket.socket) -> None:
    """The zygote's loop: start keepers on request, reap them, write their statuses."""
    from rlcore.isolation.reward_worker_loop import keep  # noqa: F401  (imported before any fork)

    # Ctrl-C reaches the run's process group: the run stops in its own time, scoring meanwhile
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    conn = Connection(os.dup(sock.fileno()))
    try:
        path, blob, actor_pid = conn.recv()
    except (EOFError, OSError):
        os._exit(0)
    sys.path[:] = path
    try:  # the actor's pidfd: how it sees the actor end (a process forked there may hold the socket)
        actor = os.pidfd_open(actor_pid)
    except ProcessLookupError:
        os._exit(0)
    except (AttributeError, OSError) as exc:  # Linux < 5.3
        conn.send(("error", f"cannot watch its keepers (pidfd_open: {exc})"))
        os._exit(0)
    try:
        owner = pickle.loads(blob)
    except BaseException as exc:  # the environment's module failed to import here: the actor forks instead
        conn.send(("error", f"could not load the environment: {type(exc).__name__}: {exc}"))
        os._exit(0)
    del blob
    from rlcore.isolation.reward_worker_walls import worker_filter

    for network in (False, True):  # built once here, not in every worker
        try:
            worker_filter(network)
        except OSError:
            pass  # each worker says so
    for name in getattr(owner, "reward_imports", ()):
        try:
            importlib.import_module(name)
        except Exception:  # the call that imports it fails with the reason, as it would anywhere
            pass
    try:
        conn.send(("ready", os.getpid()))
    except OSError:  # the actor let it go while it started (its pool closed, its process exiting)
        os._exit(0)
    keepers: dict[int, Progress] = {}
    sel = selectors.DefaultSelector()
    sel.register(sock, selectors.EVENT_READ)
    sel.register(actor, selectors.EVENT_READ, "actor")
    signal.signal(signal.SIGTERM, lambda *_: _end(keepers))
    while True:
        for key, _ in sel.select():
            if key.fileobj is sock:
                _start_one(sock, conn, owner, keepers, sel)
            elif key.data == "actor":
                _end(keepers)
            else:
                pid = key.data
                sel.unregister(key.fileobj)
                os.close(key.fd)
                _, status = os.waitpid(pid, 0)
                progress = keepers.pop(pid)
                progress[EXIT] = status
                progress.close()


def _start_one(sock, conn, owner, keepers: dict[int, Progress], sel) -> None:
    from rlcore.isolation.reward_worker_loop import keep

    try:
        _, memory_mb, network = conn.recv()
        conn_fd, progress_fd = recvfds(sock, 2)
    except (EOFError, OSError):
        _end(keepers)
    progress = Progress(progress_fd)
    try:
        pid = os.fork()
    except OSError as exc:  # out of processes or memory: this worker is refused, the zygote goes on
        progress.close()
        os.close(conn_fd)
        conn.send(("refused", f"fork failed: {exc}"))
        return
    if pid == 0:
        try:
            # not the zygote's handler (it would end the siblings) until `keep` installs its own
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a fork of the actor
            # the keeper (and its worker) hold their own pipe and progress, not their siblings'
            for fd in map(int, os.listdir("/proc/self/fd")):
                if fd > 2 and fd not in (conn_fd, progress_fd):
                    try:
                        os.close(fd)
                    except OSError:
                        pass
            keep(Connection(conn_fd), owner, progress, progress, os.getppid(), memory_mb, network)
        finally:
            os._exit(1)
    os.close(conn_fd)
    keepers[pid] = progress
    pidfd = os.pidfd_open(pid)  # its own child, not yet reaped: the pid names it
    sel.register(pidfd, selectors.EVENT_READ, pid)
    conn.send(("started", pid))
    sendfds(sock, [pidfd])  # the actor signals the keeper through it, never by a pid that may be reused


def _end(keepers: dict[int, Progress]) -> None:
    pids = list(keepers)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)  # a keeper asked so kills its worker and what that left
        except ProcessLookupError:
            pass
    until = time.monotonic() + 1.0
    for pid in pids:
        while time.monotonic() < until:
            try:
                if os.waitpid(pid, os.WNOHANG)[0]:
                    break
            except ChildProcessError:
                break
            time.sleep(0.005)
    os._exit(0)  # keepers still alive get SIGKILL from their PR_SET_PDEATHSIG


def main(fd: str, actor_pid: str) -> None:
    """The zygote process's entry: serve the actor (`actor_pid`, its parent) on socket `fd`;
    killed at once when the actor dies (PR_SET_PDEATHSIG, checked after it is set)."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != int(actor_pid):  # it died while this one started
        os._exit(0)
    serve(socket.socket(fileno=int(fd)))
