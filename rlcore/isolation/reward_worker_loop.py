"""The reward worker process: what runs after the fork (:mod:`rlcore.isolation.reward_workers` is
the parent's side). Over 400 lines: the keeper, the loop, the call's process and the signals
between them are one protocol, read together.

A worker serves batches: the parent sends the calls one request needs in one message, the worker
runs them one after another and sends all their outcomes back in one message. Between two calls
it publishes which call it is on and since when (`progress`, shared memory), so the parent can
move the rest of a batch away from a call that overruns (and kill it at its deadline) without a
message per call. Each call runs in a process of its own, forked from the worker
(:func:`run_forked`), so the worker itself never runs reward code and every call starts from its
state (issue 54):

- the call's process holds no descriptor to the actor (it cannot write a frame) and writes its
  outcome, as a reply's row, on a pipe of its own, which the worker reads and checks: no call
  can write another call's outcome;
- what the call changes in memory (its class or module, objects mutated in place, a patched
  worker loop, writes through ctypes, the working directory, signal handlers, resource limits,
  descriptors) dies with its process; the worker is not dumpable and holds no CAP_SYS_PTRACE
  (its filter refuses ptrace), so a call cannot write the worker's memory either;
- whatever the call started (children, their children, double-forked daemons) is killed: the
  worker is its PID namespace's init (or else a child subreaper), so orphans of the call's
  processes become its children and none escapes;
- a call that exceeds the memory bound (RLIMIT_DATA: what the worker had mapped at start plus
  the bound, the free heap it inherited held first, so a call cannot fill it) fails with a line
  naming the bound;
- an outcome whose value is not plain data or would not fit a reply becomes an error.

A fork per call costs what a warm process's fork costs (see docs/benchmarks.md, issue 54); it
buys a boundary that no check of the process after a call can give (ctypes writes anything).

Outcomes finished before a call that overruns need not wait for it: the parent, when it moves
the rest of a batch away from an overrun, asks with `FLUSH_SIGNAL`, and the worker sends the
outcomes it has not sent yet at once (a reply that is not the batch's last; each reply says
where in the batch its outcomes start). The signal reaches the worker, never the call's process.

A call that misses its deadline is ended by its worker (`ABANDON_SIGNAL`: the worker kills the
call's process, whatever it runs, C included) and the worker is reused, so a storm of hung calls
costs workers only while they overlap, not a kill and a new worker per call.

Between the worker and the actor sits a keeper process (:func:`keep`), which puts the worker in a
PID namespace of its own (:mod:`rlcore.isolation.reward_worker_ns`: a reward cannot signal the actor;
where that is refused, a reward that kills its parent kills the keeper, and the actor names it);
at a deadline the keeper kills the worker and whatever its calls left, in any session. Each dies
with its parent (PR_SET_PDEATHSIG, checked after it is set, so a parent that died during the fork
is seen too).
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import pickle
import resource
import select
import signal
import socket
import sys
import time
from typing import Any

from rlcore.isolation import reward_worker_ns as ns
from rlcore.isolation import reward_worker_walls as walls
from rlcore.isolation.reward_reply import FRAME_LIMIT, BadReply, decode_row, encode_reply, encode_row
from rlcore.isolation.safety import Outcome, _describe, _Sink

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
CURRENT, STARTED, CUT, WORKER_PID, NAMESPACE = 0, 1, 2, 3, 4
"""Fields of a worker's `progress` array: the call it runs (index in its batch, -1 before the
first), when that call started (time.monotonic, shared by all processes), the last index it may
start (the parent lowers it to move the rest of the batch elsewhere), the worker's pid (as the
actor sees it), the namespaces it runs in (:mod:`rlcore.isolation.reward_worker_ns`, -1 until known)."""
ABANDON_SIGNAL = signal.SIGUSR1
"""What the actor sends a worker whose call missed its deadline: the worker kills the call's
process and is reused."""
FLUSH_SIGNAL = signal.SIGUSR2
"""What the actor sends a worker whose running call overruns: send the outcomes finished so far
(they would otherwise wait for that call's end, up to its deadline)."""
EXIT_PIPE_LOST = 3
"""Exit code of a worker whose pipe to the actor a call closed."""
EXIT_DESCENDANTS = 4
"""Exit code of a worker that could not end what a call started."""
REAP_WINDOW_S = 2.0
"""How long the worker kills and reaps what a call left before it gives up on its descendants and
exits (a fork bomb outruns it; the parent then kills the worker's whole session and replaces it).
Seconds, not rounds: a SIGKILLed process can take longer than 100 ms to become reapable on a
loaded machine (a fixed 100 rounds of 1 ms once named a plain kill a fork bomb)."""


def keep(conn, owner: Any, progress, lock, actor_pid: int, memory_mb: int, network: bool = False) -> None:
    """The keeper: the worker's parent, between it and the process that scores (the rollout
    actor). A call that signals its parent (`os.getppid()`) hits the keeper, not the actor; the
    actor sees the keeper killed and names it. The keeper heads the worker's session and is a
    child subreaper: when the worker ends (or the actor asks with SIGTERM, at a deadline) it kills
    the worker and every process the worker's calls left, then exits with the worker's status."""
    os.setsid()  # its own session: nothing here gets the actor's terminal or process-group signals
    _die_with(actor_pid)
    # a fork of the actor holds every descriptor it had (other workers' pipes and progress, Ray's
    # sockets): the worker keeps its own pipe and progress only
    walls.close_fds_but({0, 1, 2, conn.fileno(), progress.fd})
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1)
    keeper = os.getpid()
    namespace = ns.enter(network)  # the worker cannot name the actor's processes (nor, mostly, the network)
    progress[NAMESPACE] = namespace
    walls.hide_cluster(memory_mb)  # where a mount namespace was had
    walls.scrub_environment(network)
    gate_r, gate_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(gate_w)
        os.read(gate_r, 1)  # the keeper has sent the actor this process's pidfd: nothing precedes it
        os.close(gate_r)
        os.setsid()  # killpg(0) from a call reaches the worker alone, not the keeper
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})  # blocked in a keeper the actor forked
        _die_with(keeper)
        serve(conn, owner, progress, lock, memory_mb, namespace != ns.NONE, network)
    os.close(gate_r)
    _send_hello(conn, pid, namespace)
    os.write(gate_w, b"x")
    os.close(gate_w)
    conn.close()

    def stop(*_) -> None:
        end_descendants(kill_first=[pid])
        os._exit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})  # a stop that came meanwhile runs `stop` now
    _, status = os.waitpid(pid, 0)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    end_descendants()
    os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status))


def _send_hello(conn, pid: int, namespace: int) -> None:
    """The first frame on the worker's pipe, from the keeper before the worker may write: the
    worker's pidfd (its own child, not yet reaped: the pid names it) and its namespaces. The
    actor signals the worker through that pidfd alone."""
    body = json.dumps({"hello": namespace, "walls": sorted(ns.entered)}).encode()
    data = len(body).to_bytes(4, "big", signed=True) + body
    pidfd = os.pidfd_open(pid)
    sock = socket.socket(fileno=os.dup(conn.fileno()))
    try:
        sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, pidfd.to_bytes(4, sys.byteorder))])
    except OSError:
        pass  # the actor is gone or closed the pipe: the worker finds that out itself
    finally:
        sock.close()
        os.close(pidfd)


def _die_with(parent_pid: int) -> None:
    """SIGKILL this process when `parent_pid` (its parent) ends; exit now if it already has."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if ns.host_ppid() != parent_pid:
        os._exit(0)


def serve(conn, owner: Any, progress, lock, memory_mb: int, namespace_init: bool, network: bool = False) -> None:
    """The worker's main loop (never returns): run batches of `owner`'s methods for the actor.
    `namespace_init`: the worker is pid 1 of a PID namespace of its own."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1)
    _namespace_init[0] = namespace_init
    progress[WORKER_PID] = ns.host_pid()
    signal.signal(ABANDON_SIGNAL, _abandon)
    signal.signal(FLUSH_SIGNAL, _flush)
    # the flush interrupts the worker's own wait for a call's outcome (Python retries it after the
    # handler); a call runs in a process of its own, which the actor never signals
    signal.siginterrupt(FLUSH_SIGNAL, True)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):  # not the actor's terminal or log files
        os.dup2(devnull, fd)
    os.close(devnull)
    limit_memory(memory_mb)
    walls.limit_descriptors()
    walls.refuse_unbounded_memory(network)
    walls.keep_calls_out_of_the_worker()
    gc.freeze()  # what the worker has now is never collected: a call's process copies fewer pages
    while True:
        try:
            batch_id, batch = pickle.loads(conn.recv_bytes())  # from the actor: trusted
        except (EOFError, OSError):
            os._exit(0)
        _batch.update(conn=conn, outs=[], sent=0, id=batch_id)
        outs = run_batch(owner, batch, progress, lock, memory_mb, conn.fileno(), _batch["outs"])
        try:
            conn.send_bytes(encode(outs[_batch["sent"] :], _batch["sent"], final=True))
        except Exception:  # the call closed the pipe: the actor sees this worker die during it
            os._exit(EXIT_PIPE_LOST)


def run_batch(
    owner: Any, batch: list[bytes], progress, lock, memory_mb: int, pipe_fd: int, outs: list[Outcome]
) -> list[Outcome]:
    """Run the batch's calls in order until the parent's cut, each in a process of its own
    (:func:`run_forked`), appending each outcome to `outs`, which it returns. The worker is never
    retired for what a call did: it runs no reward code itself."""
    for k, blob in enumerate(batch):
        with lock:
            if k > progress[CUT]:
                break
            progress[CURRENT], progress[STARTED] = k, time.monotonic()
        out = run_forked(owner, blob, pipe_fd, progress.fd)
        end_descendants()
        if out.error is not None and out.error.startswith("MemoryError"):
            out.error = (
                f"reward exceeded the reward worker's memory bound (env.reward.memory_mb={memory_mb}): {out.error}"
            )
        outs.append(out)
    return outs


_child = [0]
"""The pid of the process running the current call (0: none)."""
_abandoned = [False]


def run_forked(owner: Any, blob: bytes, pipe_fd: int, progress_fd: int = -1) -> Outcome:
    """One call in a fork of this worker: the child holds no descriptor to the actor (it cannot
    write a frame), runs the call, writes its outcome row (length-prefixed JSON) on a pipe of its
    own and exits, so nothing the call changes in memory (class or module state, objects mutated
    in place, ctypes writes, a patched worker loop) outlives it. Its outcome is what this process
    reads from that pipe by the time the child ended, checked like the actor checks a reply's rows."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the call's process
        exit_ = os._exit  # what sends its outcome, as it was before the call (which may patch them)
        try:
            dumps, write, row, length = json.dumps, os.write, encode_row, len
            os.close(r)
            os.close(pipe_fd)
            if progress_fd >= 0:
                os.close(progress_fd)  # no record lock on the progress for the call (its mapping stays)
            os.setpgid(0, 0)  # killpg(0) from the call reaches the call alone
            _child[0] = 0
            _batch.update(conn=None, outs=[], sent=0)
            out = run_one(owner, blob)
            data = dumps(row(out), allow_nan=True).encode()
            if length(data) > FRAME_LIMIT // 2:
                data = dumps(
                    [
                        None,
                        f"reward returned a value of {length(data)} bytes as JSON (limit {FRAME_LIMIT})",
                        out.output[:1024],
                    ]
                ).encode()
            data = length(data).to_bytes(4, "big") + data
            while data:
                data = data[write(w, data) :]
        finally:
            exit_(0)
    os.close(w)
    _abandoned[0] = False
    _child[0] = pid
    try:
        data = _read_outcome(r, pid)
    finally:
        os.close(r)
        _child[0] = 0
    _, status = os.waitpid(pid, 0)
    if _abandoned[0]:
        return Outcome(error="CallAbandoned: abandoned at its deadline")
    size = int.from_bytes(data[:4], "big") if len(data) >= 4 else -1
    if size < 0 or len(data) != 4 + size:
        how = (
            f"exited with code {os.WEXITSTATUS(status)}"
            if os.WIFEXITED(status)
            else f"was killed by signal {os.WTERMSIG(status)}"
        )
        return Outcome(error=f"the reward's process {how} before it sent an outcome")
    try:
        return decode_row(json.loads(data[4:]))
    except BadReply as exc:
        return Outcome(error=f"the reward's process sent {exc}")
    except (ValueError, RecursionError) as exc:
        return Outcome(error=f"the reward's process sent an outcome that is not JSON ({exc})")


def _read_outcome(r: int, pid: int) -> bytes:
    """What the call's process `pid` wrote on `r`: up to one whole length-prefixed outcome, read
    until it is whole or the process ended (a process the call started may hold the pipe open)."""
    data = bytearray()
    pidfd = os.pidfd_open(pid)
    try:
        while True:
            readable, _, _ = select.select([r, pidfd], [], [])
            if r in readable:
                chunk = os.read(r, 1 << 16)
                data += chunk
                whole = len(data) >= 4 and len(data) >= 4 + int.from_bytes(data[:4], "big")
                if not chunk or whole or len(data) > FRAME_LIMIT:
                    return bytes(data)
                continue
            os.set_blocking(r, False)  # it ended: take what it wrote, if any
            try:
                while len(data) <= FRAME_LIMIT and (chunk := os.read(r, 1 << 16)):
                    data += chunk
            except BlockingIOError:
                pass
            return bytes(data)
    finally:
        os.close(pidfd)


class CallAbandoned(BaseException):
    """Raised in a call the actor gave up on at its deadline (SIGUSR1): a BaseException, so the
    call's `except Exception` does not swallow it."""


_in_call = [False]


def _abandon(signum, frame) -> None:
    # in the worker: the call's process dies (whatever it runs, C included) and the worker is reused
    if _child[0]:
        _abandoned[0] = True
        try:
            os.kill(_child[0], signal.SIGKILL)
        except ProcessLookupError:
            pass
        return
    # in a call's own process (a reward that signals itself): raises once, inside the call only
    if _in_call[0]:
        _in_call[0] = False
        raise CallAbandoned(f"abandoned at its deadline (signal {signum})")


_batch: dict[str, Any] = {"conn": None, "outs": [], "sent": 0, "id": 0}
"""The batch being run: its pipe, its outcomes so far, how many of them were sent (`_flush`)."""


def _flush(signum, frame) -> None:
    # only while a call's process runs: between calls the main loop may be using the pipe itself
    outs, sent = _batch["outs"], _batch["sent"]
    if not _child[0] or len(outs) <= sent:
        return
    # an abandon arriving mid-send would leave half a message on the pipe
    signal.pthread_sigmask(signal.SIG_BLOCK, {ABANDON_SIGNAL})
    try:
        _batch["conn"].send_bytes(encode(outs[sent:], sent, final=False))
        _batch["sent"] = len(outs)
    except Exception:  # the call closed the pipe: the check after it names that
        pass
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {ABANDON_SIGNAL})


def run_one(owner: Any, blob: bytes) -> Outcome:
    sink = _Sink()
    sys.stdout = sys.stderr = sink
    try:
        name, args = pickle.loads(blob)
        try:
            _in_call[0] = True
            value = getattr(owner, name)(*args)
        finally:
            _in_call[0] = False
        out = Outcome(value=value)
    except BaseException as exc:  # user code: any failure is data (SystemExit, KeyboardInterrupt too)
        out = Outcome(error=_describe(exc))
    finally:
        sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
    out.output = sink.text()
    return out


def encode(outs: list[Outcome], start: int = 0, final: bool = True) -> bytes:
    """A reply (:mod:`rlcore.isolation.reward_reply`: JSON, no pickle) for the running batch: the
    outcomes of its calls from index `start` on, and whether it is the batch's last reply. It never
    asks the actor to retire the worker (the protocol keeps the field for the actor's side)."""
    return encode_reply(int(_batch["id"]), outs, start, final, retire=False)


def limit_memory(memory_mb: int) -> None:
    """Bound what this process may add to its data (heap, anonymous mappings) to `memory_mb`.
    RLIMIT_DATA counts mappings, not use: the free space of a heap the process inherited (a fork
    of the actor holds the actor's, hundreds of MiB after a model load) is already mapped, and a
    call could fill it past the bound without one new mapping. So the free heap is taken first
    (:func:`hold_free_heap`) and the limit is set on what is mapped after."""
    if memory_mb <= 0:
        return
    hold_free_heap()
    with open("/proc/self/status") as f:
        data_kb = next(int(line.split()[1]) for line in f if line.startswith("VmData:"))
    want = (data_kb * 1024) + memory_mb * (1 << 20)
    _, hard = resource.getrlimit(resource.RLIMIT_DATA)
    resource.setrlimit(resource.RLIMIT_DATA, (want if hard == resource.RLIM_INFINITY else min(want, hard), hard))


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks")
    ] + [("keepcost", ctypes.c_size_t)]


HOLD_MIN_BYTES = 64 << 10
"""Free heap chunks smaller than this are left free: a call fills them one allocation at a time
(Python's small objects live in arenas of their own, which are new mappings), and holding each
one would cost a malloc apiece at every worker start."""
_held: list[int] = []
"""The free heap this worker holds (addresses from malloc, never freed, never touched)."""


def hold_free_heap(max_mallocs: int = 4096) -> int:
    """Allocate, and keep, the free space of this process's malloc heap in chunks of at least
    :data:`HOLD_MIN_BYTES`, without touching it: after `malloc_trim` gave its pages back to the
    kernel it costs no memory, and no later allocation can be served from it, so what a call
    allocates past the smaller chunks left needs a new mapping, which RLIMIT_DATA counts. A try is
    kept only where the process's data did not grow (it came from free space); a try that grew it
    is freed and the size halved. Returns the bytes held; 0 where glibc's `mallinfo2` (2.33+) is
    missing."""
    libc = ctypes.CDLL(None, use_errno=True)
    try:
        mallinfo2 = libc.mallinfo2
    except AttributeError:
        return 0
    mallinfo2.restype = _MallInfo2
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    libc.malloc_trim(0)
    statm = os.open("/proc/self/statm", os.O_RDONLY)

    def data_pages() -> bytes:  # statm's 6th field (data + stack, in pages): one cheap read
        return os.pread(statm, 256, 0).split()[5]

    held, size = 0, mallinfo2().fordblks
    try:
        for _ in range(max_mallocs):
            if size < HOLD_MIN_BYTES:
                break
            before = data_pages()
            address = libc.malloc(size)
            if address and data_pages() == before:
                _held.append(address)
                held += size
            else:
                if address:
                    libc.free(address)
                size //= 2
    finally:
        os.close(statm)
    libc.malloc_trim(0)  # what a freed try left at the heap's top
    return held


def children() -> list[int]:
    """This process's child pids (orphans it adopted as subreaper included)."""
    try:
        return [
            int(p)
            for tid in os.listdir("/proc/self/task")
            for p in open(f"/proc/self/task/{tid}/children").read().split()
        ]
    except OSError:  # no CONFIG_PROC_CHILDREN: scan the process table
        me, kids = os.getpid(), []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == me:
                        kids.append(int(pid))
            except (OSError, ValueError, IndexError):
                continue
        return kids


_namespace_init = [False]


def _every_other_member() -> tuple[int, ...]:
    return (-1,)  # kill(-1) from a namespace's init: every member but itself, in any session


def end_descendants(kill_first: list[int] = ()) -> None:
    """SIGKILL and reap every process the last call left behind (one cheap syscall when none)."""
    if _namespace_init[0]:  # the pids /proc shows are not this namespace's: kill(-1) names them all
        targets = _every_other_member
    else:
        for pid in kill_first:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        targets = children
    if not ns.kill_and_reap(REAP_WINDOW_S, targets):
        os._exit(EXIT_DESCENDANTS)  # it outruns us: the parent kills this session and replaces the worker
