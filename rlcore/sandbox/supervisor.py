"""PID 1 of a sandbox: runs one command inside bubblewrap, bounds its whole process tree, reports.

Started by :class:`rlcore.sandbox.local.LocalSandbox` as ``bwrap ... --as-pid-1 python -I
/sandbox/supervisor.py FD`` (a script: standard library only). The spec (argv, env, limits, the
input files) comes on stdin; the report (JSON: `status`, `cpu_s`, `timed_out`, `leftover`,
`memory_mb`, `files`, `error`) goes to file descriptor FD, which the command never holds.

- It writes the input files into the work directory (the tmpfs whose size is the disk quota).
- The command (PID 2) gets, where the spec names a `uid` (a root caller), that uid and no groups
  (every capability goes with the change); its own session, rlimits (CPU, address space, file size, open files,
  processes; no POSIX message queue or locked memory), no core dumps, every other file descriptor
  closed, the default SIGPIPE and SIGXFSZ, and a second syscall filter on top of the sandbox's
  (the spec's `command_filter`: no netlink socket, which only this process may hold).
- Every `poll_s` it reaps, checks the wall clock, and sums the memory the tree holds: the resident
  memory of every process in the namespace and what the AF_UNIX sockets of its network namespace
  hold (:func:`socket_mb`); above `memory_mb` the whole tree is killed. It also counts the
  work directory's inodes (statvfs): above `max_files` the tree is killed (`work_dir_limit`).
- The kernel delivers a signal sent from inside the namespace to its PID 1 only where PID 1 has a
  handler; this process keeps none (Python's SIGINT handler is removed), so the command cannot
  signal it, even where both share a uid (a non-root caller's user namespace).
- When the command exits (or the tree is killed), whatever is still running outlived it: it is
  counted and killed; then (as the command's uid, its privileges given up for good) the text
  files left in the work directory are read into the report by a bounded, iterative walk that
  opens regular files only (never a FIFO, device, socket or link) and stops at `max_files`
  entries or `MAX_DEPTH` levels (`work_dir_limit` in the report).
"""

import _socket  # not `socket`: its imports (selectors, enum members) cost ~2 ms a run
import ctypes
import json
import os
import resource
import signal
import stat
import struct
import sys
import time
import warnings  # noqa: F401  (os.execvpe imports it lazily; load it before the limits apply)

PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 4, 38, 22, 2
MAX_COLLECT = 256 * 1024  # bytes of files collected back per run
PAGE = os.sysconf("SC_PAGE_SIZE")
MAX_DEPTH = 64  # directory levels of the work directory read back
NETLINK_SOCK_DIAG, SOCK_DIAG_BY_FAMILY, NLM_F_DUMP_REQUEST, NLMSG_ERROR, NLMSG_DONE = 4, 20, 0x301, 2, 3
UDIAG_SHOW_MEMINFO, UNIX_DIAG_MEMINFO = 0x20, 5


def set_limits(limits: dict) -> None:
    mem = limits["memory_mb"] * 2**20
    fsize = limits["file_size_mb"] * 2**20
    resource.setrlimit(resource.RLIMIT_CPU, (limits["cpu_s"], limits["cpu_s"] + 1))
    resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
    resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
    resource.setrlimit(resource.RLIMIT_NPROC, (limits["max_processes"], limits["max_processes"]))
    resource.setrlimit(resource.RLIMIT_MSGQUEUE, (0, 0))  # POSIX message queues: kernel memory
    resource.setrlimit(resource.RLIMIT_MEMLOCK, (0, 0))


def command(spec: dict) -> None:
    """PID 2: become the untrusted command (never returns)."""
    try:
        os.closerange(3, 65536)  # the report fd above all: the command must not forge it
        for sig in (signal.SIGPIPE, signal.SIGXFSZ):  # Python ignores them; a command gets the defaults
            signal.signal(sig, signal.SIG_DFL)
        os.setsid()
        become(spec.get("uid"))
        set_limits(spec["limits"])
        add_filter(bytes.fromhex(spec["command_filter"]))
        os.chdir(spec["workdir"])
        os.execvpe(spec["argv"][0], spec["argv"], spec["env"])
    except BaseException as exc:  # noqa: BLE001  (report anything, then leave without cleanup)
        os.write(2, f"sandbox: cannot start {spec['argv'][0]!r}: {exc}\n".encode())
    os._exit(127)


class SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def add_filter(bpf: bytes) -> None:
    """Stack a seccomp filter (an array of 8-byte BPF instructions) on this process (OSError)."""
    libc = ctypes.CDLL(None, use_errno=True)
    code = ctypes.create_string_buffer(bpf, len(bpf))
    prog = SockFprog(len(bpf) // 8, ctypes.cast(code, ctypes.c_void_p))
    zero = ctypes.c_ulong(0)
    if (
        libc.prctl(PR_SET_NO_NEW_PRIVS, ctypes.c_ulong(1), zero, zero, zero) != 0
        or libc.prctl(PR_SET_SECCOMP, ctypes.c_ulong(SECCOMP_MODE_FILTER), ctypes.byref(prog), zero, zero) != 0
    ):
        raise OSError(ctypes.get_errno(), f"cannot add the command's syscall filter: {os.strerror(ctypes.get_errno())}")


def become(uid: int | None) -> None:
    if uid is not None:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)


def give_to(uid: int | None, workdir: str) -> None:
    """The work directory and the input files belong to the command's uid."""
    if uid is None:
        return
    for root, dirs, names in os.walk(workdir):
        for path in [root, *(os.path.join(root, n) for n in dirs + names)]:
            os.chown(path, uid, uid)


def resident_mb() -> float:
    """Resident memory of every process of this PID namespace but this one (MiB)."""
    total = 0
    for name in os.listdir("/proc"):
        if not name.isdigit() or name == "1":
            continue
        try:
            with open(f"/proc/{name}/statm", "rb") as f:
                total += int(f.read().split()[1])
        except (OSError, IndexError, ValueError):
            continue  # exited meanwhile
    return total * PAGE / 2**20


def write_inputs(workdir: str, files: dict) -> None:
    for rel, text in files.items():
        path = os.path.join(workdir, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)


def socket_mb(diag: _socket.socket | None, charge: int) -> float:
    """Memory held by the AF_UNIX sockets of this network namespace (MiB): kernel memory no
    process's resident size shows (the only socket family the filter lets the command open).
    A socket still open is counted at what is charged to it (netlink sock_diag: the data it sent
    that waits in its peer's queue, and its own receive queue); one already closed whose data still
    waits in a peer's queue is no longer listed there, so every such socket (those the kernel
    counts alive, less those listed) is counted at the most it can hold, `charge` bytes."""
    if diag is None:
        return 0.0
    alive = unix_sockets_alive()
    if not alive:  # the common case, at the cost of one read: no socket, no dump
        return 0.0
    req = struct.pack("=BBHIII8x", _socket.AF_UNIX, 0, 0, 0xFFFFFFFF, 0, UDIAG_SHOW_MEMINFO)
    diag.send(struct.pack("=IHHII", 16 + len(req), SOCK_DIAG_BY_FAMILY, NLM_F_DUMP_REQUEST, 1, 0) + req)
    total, listed = 0, 0
    while True:
        try:
            data = diag.recv(1 << 16)
        except TimeoutError:  # no end-of-dump marker within a second (never seen): count what came
            break
        at, done = 0, False
        while at + 16 <= len(data):
            length, kind = struct.unpack_from("=IH", data, at)
            if kind == NLMSG_ERROR and length >= 20 and struct.unpack_from("=i", data, at + 16)[0] < 0:
                raise OSError(-struct.unpack_from("=i", data, at + 16)[0], "sock_diag refused the dump")
            if kind in (NLMSG_DONE, NLMSG_ERROR) or length < 16:
                done = True
                break
            listed += 1
            attr, end = at + 32, at + length  # past nlmsghdr and unix_diag_msg
            while attr + 4 <= end:
                alen, atype = struct.unpack_from("=HH", data, attr)
                if atype == UNIX_DIAG_MEMINFO and alen >= 4 + 16:
                    rmem, _, wmem, _ = struct.unpack_from("=4I", data, attr + 4)
                    total += rmem + wmem
                attr += max(4, (alen + 3) & ~3)
            at += (length + 3) & ~3
        if done:
            break
    closed = max(0, alive - listed)
    return (total + closed * charge) / 2**20


_PROTOCOLS: list[int] = []  # /proc/net/protocols, opened once: a pread costs a third of an open


def unix_sockets_alive() -> int:
    """AF_UNIX sockets this network namespace's kernel holds, closed ones still referenced included."""
    if not _PROTOCOLS:
        _PROTOCOLS.append(os.open("/proc/net/protocols", os.O_RDONLY | os.O_CLOEXEC))
    alive = 0
    for line in os.pread(_PROTOCOLS[0], 1 << 16, 0).split(b"\n"):
        cols = line.split(None, 3)
        if len(cols) > 2 and cols[0] in (b"UNIX", b"UNIX-STREAM"):
            alive += int(cols[2])
    return alive


def socket_charge() -> int:
    """The most one AF_UNIX socket can hold at the default buffer size (the filter refuses changing
    it): its send buffer and one more message past it."""
    try:
        with open("/proc/sys/net/core/wmem_default", "rb") as f:
            return 2 * int(f.read())
    except (OSError, ValueError):
        return 2 * 212992  # the kernel's default


def open_diag() -> _socket.socket | None:
    try:
        diag = _socket.socket(_socket.AF_NETLINK, _socket.SOCK_DGRAM, NETLINK_SOCK_DIAG)
        diag.settimeout(1.0)
        socket_mb(diag, 0)
        return diag
    except OSError:  # a kernel without unix_diag: resident memory only
        return None


def used_inodes(workdir: str) -> int:
    st = os.statvfs(workdir)
    return st.f_files - st.f_ffree


def collect(workdir: str, max_entries: int) -> tuple[dict, str | None]:
    """(text files left in the work directory, the walk limit it hit or None): an iterative walk
    that lstat()s every entry, opens regular files only (non-blocking, never following a link),
    skips names that are not UTF-8 and stops at `max_entries` entries or MAX_DEPTH levels."""
    out, budget, seen, hit = {}, MAX_COLLECT, 0, None
    stack = [("", 0)]
    while stack and hit is None:
        rel_dir, depth = stack.pop()
        try:
            with os.scandir(os.path.join(workdir, rel_dir) if rel_dir else workdir) as it:
                entries = []
                for entry in it:
                    seen += 1
                    if seen > max_entries:
                        hit = f"more than {max_entries} entries"
                        break
                    entries.append(entry)
        except OSError:
            continue  # a directory the command made unreadable
        for entry in sorted(entries, key=lambda e: e.name):
            try:
                entry.name.encode("utf-8")
            except UnicodeEncodeError:
                continue  # not UTF-8: no text key names it
            rel = f"{rel_dir}/{entry.name}" if rel_dir else entry.name
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISDIR(st.st_mode):
                if depth + 1 >= MAX_DEPTH:
                    hit = hit or f"deeper than {MAX_DEPTH} levels"
                else:
                    stack.append((rel, depth + 1))
            elif stat.S_ISREG(st.st_mode) and st.st_size + len(rel) <= budget:
                text = read_text(entry.path, budget - len(rel))
                if text is not None:
                    budget -= len(rel) + len(text)
                    out[rel] = text
    return out, hit


def read_text(path: str, most: int) -> str | None:
    """A regular file's text (None: not UTF-8, not readable, not a regular file, over `most`)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_NOCTTY)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        data = os.read(fd, most + 1)
        return data.decode() if len(data) <= most else None
    except (OSError, UnicodeDecodeError):
        return None
    finally:
        os.close(fd)


def supervise(spec: dict, inputs: int) -> dict:
    """Run the command; the report without `files`. `inputs`: the work directory's inodes before
    it (the input files, its own), which `max_files` does not count."""
    limit_mb, poll, workdir = spec["limits"]["memory_mb"], spec["poll_s"], spec["workdir"]
    max_inodes = spec["limits"]["max_files"] + inputs
    status, cpu, timed_out, leftover, peak, over, files_over = None, 0.0, False, 0, 0.0, False, False
    diag, charge = open_diag(), socket_charge()
    deadline = time.monotonic() + spec["timeout"]
    nap = 0.001  # short commands are seen to end at once; long ones cost one look per poll_s
    pid = os.fork()
    if pid == 0:
        command(spec)
    while status is None:
        done, st, usage = os.wait4(-1, os.WNOHANG)
        if done == pid:
            status, cpu = st, usage.ru_utime + usage.ru_stime
            break
        if done:
            continue  # another process of the tree: reaped, look again at once
        if time.monotonic() >= deadline:
            timed_out = True
            break
        peak = max(peak, resident_mb() + socket_mb(diag, charge))
        if peak > limit_mb:
            over = True
            break
        if used_inodes(workdir) > max_inodes:
            files_over = True
            break
        time.sleep(nap)
        nap = min(nap * 2, poll)
    try:
        os.kill(-1, signal.SIGKILL)  # everyone in the namespace but PID 1
    except ProcessLookupError:  # nobody left
        pass
    while True:
        try:
            done, st, usage = os.wait4(-1, 0)
        except ChildProcessError:
            break
        if done == pid:
            status, cpu = st, usage.ru_utime + usage.ru_stime
        elif not (over or files_over):  # a tree killed for a limit took the command with it: none outlived it
            leftover += 1
    if diag is not None:
        diag.close()
    report = {
        "status": status,
        "cpu_s": cpu,
        "timed_out": timed_out,
        "leftover": leftover,
        "memory_mb": round(peak, 1),
        "memory_exceeded": over,
    }
    if files_over:
        report["work_dir_limit"] = f"more than {spec['limits']['max_files']} files in the work directory: killed"
    return report


def main() -> int:
    report_fd = int(sys.argv[1])
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)  # /proc/1/fd and /proc/1/mem closed to the command
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # no handler: the kernel drops it when sent from inside
    spec = json.loads(sys.stdin.buffer.read())
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    try:
        write_inputs(spec["workdir"], spec["files"])
        give_to(spec.get("uid"), spec["workdir"])
    except OSError as exc:
        report = {"status": None, "timed_out": False, "leftover": 0, "error": f"cannot write the input files: {exc}"}
    else:
        inputs = used_inodes(spec["workdir"])
        report = supervise(spec, inputs)
        become(spec.get("uid"))
        try:
            report["files"], hit = collect(spec["workdir"], spec["limits"]["max_files"] + inputs)
        except Exception as exc:  # noqa: BLE001  (whatever the command left, the report goes out)
            report["files"], hit = {}, f"reading it back failed: {type(exc).__name__}: {exc}"
        if hit and "work_dir_limit" not in report:
            report["work_dir_limit"] = f"the work directory holds {hit}: files read back from part of it"
    data = json.dumps(report).encode()
    while data:
        data = data[os.write(report_fd, data) :]
    return 0


if __name__ == "__main__":
    sys.exit(main())
