"""LocalSandbox: run untrusted code on this machine inside kernel namespaces.

`isolation="namespaces"` (default) is the boundary: every run goes through
:mod:`rlcore.sandbox.launcher`, which gives the command its own PID, mount, network, IPC and UTS
namespaces (plus a user namespace when the caller is not root), a read-only filesystem except
its work dir, an ordinary uid with no capabilities, rlimits including RLIMIT_NPROC, and a hard
wall-clock kill of the whole process tree. Namespaces come straight from the kernel (ctypes
`unshare`), so nothing beyond Python is installed. Where the kernel refuses them (user namespaces
disabled and not root), constructing the sandbox raises :class:`SandboxUnavailable`, one line.

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
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rlcore.sandbox.base import Limits, Sandbox, SandboxResult, check_relative

log = logging.getLogger("rlcore")
_GUARD = Path(__file__).with_name("guard.py")
_LAUNCHER = Path(__file__).with_name("launcher.py")
_MAX_COLLECT = 256 * 1024  # bytes of files (and of stdout/stderr) collected back per run
ISOLATION = ("namespaces", "weak")
_UID_BASE = 1_000_000_000  # + the launcher's pid: an ordinary uid no account uses
_INNER_UID = 1000  # the command's uid inside its user namespace (callers that are not root)
# what the kernel (or the audit hook) prints when it refuses an escape attempt
_REFUSED = re.compile(r"PermissionError: sandbox:|Read-only file system|Operation not permitted|"
                      r"permission denied|must be superuser|Resource temporarily unavailable|Bad system call",
                      re.IGNORECASE)


class SandboxUnavailable(RuntimeError):
    """The kernel refuses the namespaces the sandbox needs (one line saying why and what to do)."""


def _python_layout() -> tuple[str, str]:
    """(installation dir, interpreter path relative to it) of the interpreter running this."""
    prefix = os.path.realpath(sys.base_prefix)
    exe = os.path.realpath(sys.executable)
    if not exe.startswith(prefix + os.sep):  # a venv whose interpreter lives elsewhere
        prefix = os.path.dirname(os.path.dirname(exe))
    return prefix, os.path.relpath(exe, prefix)


_PROBE: dict[str, str | None] = {}


def namespaces_problem() -> str | None:
    """None when namespaced runs work here; otherwise the kernel's refusal, one line (cached)."""
    if "ns" not in _PROBE:
        sandbox = LocalSandbox.__new__(LocalSandbox)
        sandbox.limits, sandbox.isolation = Limits(timeout_s=30), "namespaces"
        r = sandbox.run(["python", "-c", "import os; print(os.getpid(), os.getuid())"])
        if r.returncode == 0 and r.stdout.split() and r.stdout.split()[0] == "2":
            _PROBE["ns"] = None
        else:
            _PROBE["ns"] = (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1]
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


def _reason(returncode: int | None, stderr: str, timed_out: bool, violations: list[str]) -> str | None:
    if timed_out:
        return "timeout"
    if returncode in (-signal.SIGXCPU, -signal.SIGKILL):
        return "cpu_limit" if returncode == -signal.SIGXCPU or "MemoryError" not in stderr else "memory_limit"
    if returncode == -signal.SIGXFSZ:
        return "file_size_limit"
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
        """`isolation`: `namespaces` (a boundary; raises SandboxUnavailable where the kernel
        refuses) or `weak` (rlimits and the Python audit hook only; warned about)."""
        if isolation not in ISOLATION:
            raise ValueError(f"sandbox isolation: choose one of {list(ISOLATION)}, got {isolation!r}")
        self.limits = limits or Limits()
        self.isolation = isolation
        if isolation == "namespaces":
            problem = namespaces_problem()
            if problem is not None:
                raise SandboxUnavailable(
                    f"the kernel refuses the namespaces the sandbox needs ({problem}); run as root or enable "
                    "user namespaces (sysctl user.max_user_namespaces / kernel.unprivileged_userns_clone), "
                    "or opt in to sandbox_isolation=weak (NOT a security boundary)")
        else:
            log.warning("SANDBOX IS WEAK: untrusted code runs as this user with rlimits and a Python audit hook "
                        "only; it can escape (sandbox_isolation=weak)")

    def _env(self, workdir: str, guard_dir: str) -> dict[str, str]:
        return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8",
                "PYTHONPATH": guard_dir, "PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1",
                "RLCORE_SANDBOX_ROOT": workdir}

    def run(self, cmd: list[str], files: dict[str, str] | None = None, timeout: float | None = None) -> SandboxResult:
        timeout = self.limits.timeout_s if timeout is None else timeout
        base = tempfile.mkdtemp(prefix="rlcore-sandbox-")
        try:
            workdir, guard_dir = os.path.join(base, "work"), os.path.join(base, "guard")
            os.makedirs(workdir)
            os.makedirs(guard_dir)
            shutil.copy(_GUARD, os.path.join(guard_dir, "sitecustomize.py"))
            for rel, text in (files or {}).items():
                path = os.path.join(workdir, check_relative(rel))
                os.makedirs(os.path.dirname(path), exist_ok=True)
                Path(path).write_text(text)
            out_path, err_path = os.path.join(base, "stdout"), os.path.join(base, "stderr")
            start = time.monotonic()
            with open(out_path, "wb") as out, open(err_path, "wb") as err:
                if self.isolation == "namespaces":
                    status = self._run_namespaced(base, workdir, cmd, self._env(workdir, guard_dir), timeout, out, err)
                else:
                    status = self._run_weak(workdir, cmd, self._env(workdir, guard_dir), timeout, out, err)
            duration = time.monotonic() - start
            stdout = _read_head(out_path)
            stderr = _read_head(err_path)
            if status.get("error"):
                return SandboxResult(None, stdout, f"{stderr}sandbox: {status['error']}\n", "isolation_failed",
                                     duration_s=duration)
            raw = status.get("status")
            returncode = None if raw is None else os.waitstatus_to_exitcode(raw)
            violations = find_violations(stderr, status.get("leftover", 0))
            return SandboxResult(returncode, stdout, stderr, _reason(returncode, stderr, status["timed_out"], violations),
                                 _collect(workdir), duration, violations)
        finally:
            shutil.rmtree(base, ignore_errors=True)

    def _run_namespaced(self, base, workdir, cmd, env, timeout, out, err) -> dict:
        python_src, python_rel = _python_layout()
        python_dst = os.path.join(base, "python")
        os.makedirs(python_dst)
        argv = [os.path.join(python_dst, python_rel) if i == 0 and a in ("python", "python3") else a
                for i, a in enumerate(cmd)]
        root = os.geteuid() == 0
        read_fd, write_fd = os.pipe()
        spec = {"mode": "root" if root else "userns", "workdir": workdir, "argv": argv, "env": env,
                "timeout": timeout, "limits": vars(self.limits), "python_src": python_src, "python_dst": python_dst,
                "inner_uid": _INNER_UID, "status_fd": write_fd}
        try:
            proc = subprocess.Popen([sys.executable, "-I", str(_LAUNCHER), "-"], stdin=subprocess.PIPE, stdout=out,
                                    stderr=err, pass_fds=(write_fd,), start_new_session=True,
                                    env={"PATH": env["PATH"]})
        except OSError as exc:
            os.close(read_fd)
            os.close(write_fd)
            return {"error": f"cannot start the launcher: {exc}"}
        os.close(write_fd)
        if root:  # the command's uid is only known now: 1e9 + the launcher's pid
            spec["uid"] = _UID_BASE + proc.pid
            os.chmod(base, 0o755)
            for d, dirs, names in os.walk(workdir):
                for n in [d, *(os.path.join(d, x) for x in dirs), *(os.path.join(d, x) for x in names)]:
                    os.chown(n, spec["uid"], spec["uid"])
        proc.stdin.write(json.dumps(spec).encode())
        proc.stdin.close()
        try:  # the launcher enforces the deadline itself; this is the backstop if it hangs
            proc.wait(timeout=timeout + 30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # init dies with it (parent-death signal), then the namespace
            proc.wait()
        with os.fdopen(read_fd, "rb") as f:
            raw = f.read()
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            return {"error": f"launcher exited {proc.returncode} without a status"}

    def _run_weak(self, workdir, cmd, env, timeout, out, err) -> dict:
        argv = [sys.executable if i == 0 and a in ("python", "python3") else a for i, a in enumerate(cmd)]
        try:
            proc = subprocess.Popen(argv, cwd=workdir, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                    preexec_fn=_weak_preexec(self.limits))
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
        return {"status": raw, "timed_out": timed_out, "leftover": 0}


def _read_head(path: str) -> str:
    with open(path, "rb") as f:
        return f.read(_MAX_COLLECT).decode(errors="replace")


def _collect(workdir: str) -> dict[str, str]:
    """Text files left in the working directory (bounded; binary files are skipped)."""
    out, budget = {}, _MAX_COLLECT
    for root, _, names in os.walk(workdir):
        for n in sorted(names):
            path = os.path.join(root, n)
            if os.path.islink(path) or os.path.getsize(path) > budget:
                continue
            try:
                text = Path(path).read_text()
            except (UnicodeDecodeError, OSError):
                continue
            budget -= len(text)
            out[os.path.relpath(path, workdir)] = text
    return out
