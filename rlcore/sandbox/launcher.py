"""Sandbox launcher: run one command inside fresh kernel namespaces (a script, standard library only).

Started by :class:`rlcore.sandbox.local.LocalSandbox` as ``python -I launcher.py -`` (spec on stdin) in a
new, single-threaded process (so it may fork and unshare safely whatever threads the caller has).
Three processes:

- **launcher** (here): leaves the caller's mount, network, PID, IPC and UTS namespaces (and, when
  it is not root, its user namespace: the caller's uid is mapped to an unprivileged uid inside).
  In its private mount namespace it binds the work dir and the Python installation, then
  remounts every other mount read-only. Mount flags set here, by a more privileged namespace,
  cannot be cleared by the command (it has no CAP_SYS_ADMIN).
- **init** (PID 1 of the new PID namespace): mounts a fresh /proc, starts the command, reaps
  everything, enforces the wall clock (SIGKILL to every process of the namespace), counts the
  processes still alive when the command exited, then kills them. When it exits, the kernel
  kills whatever is left in the namespace.
- **command** (PID 2): own session, rlimits (CPU, address space, file size, open files,
  processes), no core dumps; as root the launcher gives it a uid of its own (1e9 + launcher
  pid: unique among running sandboxes, so RLIMIT_NPROC counts this sandbox alone) and no
  groups; `no_new_privs` so no setuid binary or file capability raises it again.

The command cannot see or signal any process outside its PID namespace, and its network
namespace has only a loopback device that is down. The launcher writes a JSON status
(`status`, `timed_out`, `leftover`, `error`) to the file descriptor `status_fd` (a pipe to the
caller, closed in init and the command so they cannot forge it).
"""

import ctypes
import json
import os
import resource
import signal
import sys
import time
import warnings  # noqa: F401  (os.execvpe imports it lazily: after the uid drop, the stdlib may be unreadable)

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC, MS_PRIVATE, MS_RELATIME = 1024, 2048, 4096, 16384, 1 << 18, 1 << 21
_KEEP = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": MS_NOATIME,
         "nodiratime": MS_NODIRATIME, "relatime": MS_RELATIME}
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
# mounts left writable: the fresh /proc replaces /proc; ptys need devpts
_WRITABLE = ("/proc", "/dev/pts")

libc = ctypes.CDLL(None, use_errno=True)


class SetupError(Exception):
    pass


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise SetupError(f"{what}: {os.strerror(err)}")


def _mount(src, target, fstype, flags, what):
    enc = (lambda s: None if s is None else s.encode())
    _check(libc.mount(enc(src), enc(target), enc(fstype), ctypes.c_ulong(flags), None), what)


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def enter_namespaces(spec: dict) -> None:
    flags = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS
    userns = spec["mode"] == "userns"
    uid, gid = os.geteuid(), os.getegid()
    _check(libc.unshare(flags | (CLONE_NEWUSER if userns else 0)), "unshare")
    if userns:  # the caller's uid becomes an ordinary uid inside; capabilities end at exec
        _write("/proc/self/setgroups", "deny")
        _write("/proc/self/uid_map", f"{spec['inner_uid']} {uid} 1")
        _write("/proc/self/gid_map", f"{spec['inner_uid']} {gid} 1")


def readonly_filesystem(spec: dict) -> None:
    """Every mount read-only except the work dir (and /proc, /dev/pts); the Python installation
    bound (read-only) where the unprivileged command can reach it."""
    _mount(None, "/", None, MS_REC | MS_PRIVATE, "make / private")
    work = spec["workdir"]
    _mount(work, work, None, MS_BIND, "bind the work dir")
    if spec.get("python_src"):
        _mount(spec["python_src"], spec["python_dst"], None, MS_BIND | MS_REC, "bind the Python installation")
    with open("/proc/self/mountinfo") as f:
        mounts = [line.split() for line in f]
    for fields in mounts:
        point = fields[4].replace("\\040", " ")
        if point == work or any(point == w or point.startswith(w + "/") for w in _WRITABLE):
            continue
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY
        for opt in fields[5].split(","):
            flags |= _KEEP.get(opt, 0)
        if libc.mount(None, point.encode(), None, ctypes.c_ulong(flags), None) != 0 and point in ("/", "/tmp"):
            raise SetupError(f"remount {point} read-only: {os.strerror(ctypes.get_errno())}")


def set_limits(limits: dict) -> None:
    mem = limits["memory_mb"] * 1024 * 1024
    fsize = limits["file_size_mb"] * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_CPU, (limits["cpu_s"], limits["cpu_s"] + 1))
    resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
    resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
    resource.setrlimit(resource.RLIMIT_NPROC, (limits["max_processes"], limits["max_processes"]))


def command(spec: dict, report_fd: int) -> None:
    """PID 2: become the untrusted command (never returns)."""
    try:
        os.close(report_fd)  # init's report to the launcher must not be forgeable
        os.setsid()
        set_limits(spec["limits"])
        if spec["mode"] == "root":
            os.setgroups([])
            os.setgid(spec["uid"])
            os.setuid(spec["uid"])  # from root to an ordinary uid: every capability is dropped
        _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
        os.chdir(spec["workdir"])
        os.execvpe(spec["argv"][0], spec["argv"], spec["env"])
    except BaseException as exc:  # noqa: BLE001  (report anything, then leave without cleanup)
        os.write(2, f"sandbox: cannot start {spec['argv'][0]!r}: {exc}\n".encode())
    os._exit(127)


def init(spec: dict, report_fd: int) -> None:
    """PID 1: run the command, enforce the deadline, count and kill what outlived it."""
    status, timed_out, leftover = None, False, 0
    try:
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # the launcher killed: all of us die
        # a fresh /proc shows only this namespace; where the kernel refuses it (a masked /proc in
        # a container), the old one stays: processes outside are listed but cannot be signalled
        libc.mount(b"proc", b"/proc", b"proc", ctypes.c_ulong(MS_NOSUID | MS_NODEV | MS_NOEXEC), None)
        deadline = time.monotonic() + spec["timeout"]
        pid = os.fork()
        if pid == 0:
            command(spec, report_fd)
        nap = 0.001
        while status is None:
            done, st = os.waitpid(-1, os.WNOHANG)
            if done == pid:
                status = st
            elif done == 0:
                if time.monotonic() >= deadline:
                    timed_out = True
                    break
                time.sleep(nap)
                nap = min(nap * 2, 0.02)
        # whatever is still running now outlived the command (or the deadline)
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            pass
        while True:
            try:
                done, st = os.waitpid(-1, 0)
            except ChildProcessError:
                break
            if done == pid:
                status = st
            else:
                leftover += 1
        out = {"status": status, "timed_out": timed_out, "leftover": leftover}
    except BaseException as exc:  # noqa: BLE001
        out = {"status": status, "timed_out": timed_out, "leftover": leftover, "error": f"init: {exc}"}
    os.write(report_fd, json.dumps(out).encode())
    os._exit(0)


def main() -> int:
    spec = json.loads(sys.stdin.read())  # the caller writes it once the uid's files are ready
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    report = {"status": None, "timed_out": False, "leftover": 0}
    try:
        enter_namespaces(spec)
        readonly_filesystem(spec)
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            os.close(spec["status_fd"])
            init(spec, w)
        os.close(w)
        chunks = []
        while True:
            chunk = os.read(r, 65536)
            if not chunk:
                break
            chunks.append(chunk)
        os.waitpid(pid, 0)
        if chunks:
            report = json.loads(b"".join(chunks))
        else:
            report["error"] = "init died without a report"
    except (SetupError, OSError) as exc:
        report["error"] = f"isolation failed: {exc}"
    os.write(spec["status_fd"], json.dumps(report).encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
