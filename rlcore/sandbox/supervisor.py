"""PID 1 of a sandbox: runs one command inside bubblewrap, bounds its whole process tree, reports.

Started by :class:`rlcore.sandbox.local.LocalSandbox` as ``bwrap ... --as-pid-1 python -I
/sandbox/supervisor.py FD`` (a script: standard library only). The spec (argv, env, limits, the
input files) comes on stdin; the report (JSON: `status`, `cpu_s`, `timed_out`, `leftover`,
`memory_mb`, `files`, `error`) goes to file descriptor FD, which the command never holds.

- It writes the input files into the work directory (the tmpfs whose size is the disk quota).
- The command (PID 2) gets, where the spec names a `uid` (a root caller), that uid and no groups
  (every capability goes with the change); its own session, rlimits (CPU, address space, file size, open files,
  processes), no core dumps, and every other file descriptor closed.
- Every `poll_s` it reaps, checks the wall clock, and sums the resident memory of every process
  in the namespace: above `memory_mb` the whole tree is killed. The kernel never delivers a signal
  from inside the namespace to its PID 1, so the command cannot kill this process.
- When the command exits (or the tree is killed), whatever is still running outlived it: it is
  counted and killed; then (as the command's uid, its privileges given up for good) the text
  files left in the work directory are read into the report.
"""

import ctypes
import json
import os
import resource
import signal
import sys
import time
import warnings  # noqa: F401  (os.execvpe imports it lazily; load it before the limits apply)

PR_SET_DUMPABLE = 4
MAX_COLLECT = 256 * 1024  # bytes of files collected back per run
PAGE = os.sysconf("SC_PAGE_SIZE")


def set_limits(limits: dict) -> None:
    mem = limits["memory_mb"] * 2**20
    fsize = limits["file_size_mb"] * 2**20
    resource.setrlimit(resource.RLIMIT_CPU, (limits["cpu_s"], limits["cpu_s"] + 1))
    resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
    resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
    resource.setrlimit(resource.RLIMIT_NPROC, (limits["max_processes"], limits["max_processes"]))


def command(spec: dict) -> None:
    """PID 2: become the untrusted command (never returns)."""
    try:
        os.closerange(3, 65536)  # the report fd above all: the command must not forge it
        os.setsid()
        become(spec.get("uid"))
        set_limits(spec["limits"])
        os.chdir(spec["workdir"])
        os.execvpe(spec["argv"][0], spec["argv"], spec["env"])
    except BaseException as exc:  # noqa: BLE001  (report anything, then leave without cleanup)
        os.write(2, f"sandbox: cannot start {spec['argv'][0]!r}: {exc}\n".encode())
    os._exit(127)


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


def collect(workdir: str) -> dict:
    """Text files left in the work directory (bounded; binary files and links are skipped)."""
    out, budget = {}, MAX_COLLECT
    for root, _, names in os.walk(workdir):
        for n in sorted(names):
            path = os.path.join(root, n)
            try:
                if os.path.islink(path) or os.path.getsize(path) > budget:
                    continue
                with open(path) as f:
                    text = f.read()
            except (UnicodeDecodeError, OSError):
                continue
            budget -= len(text)
            out[os.path.relpath(path, workdir)] = text
    return out


def supervise(spec: dict) -> dict:
    """Run the command; the report without `files`."""
    limit_mb, poll = spec["limits"]["memory_mb"], spec["poll_s"]
    status, cpu, timed_out, leftover, peak, over = None, 0.0, False, 0, 0.0, False
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
        peak = max(peak, resident_mb())
        if peak > limit_mb:
            over = True
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
        elif not over:  # a tree killed for its memory took the command with it: none outlived it
            leftover += 1
    return {"status": status, "cpu_s": cpu, "timed_out": timed_out, "leftover": leftover,
            "memory_mb": round(peak, 1), "memory_exceeded": over}


def main() -> int:
    report_fd = int(sys.argv[1])
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)  # /proc/1/fd and /proc/1/mem closed to the command
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
        report = supervise(spec)
        become(spec.get("uid"))
        report["files"] = collect(spec["workdir"])
    data = json.dumps(report).encode()
    while data:
        data = data[os.write(report_fd, data):]
    return 0


if __name__ == "__main__":
    sys.exit(main())
