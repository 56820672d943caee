"""LocalSandbox: run untrusted code in a subprocess on this machine, with kernel limits.

Layers, strongest first (each used where the machine allows it; `isolation` reports which):

1. **mount namespace** (`unshare(CLONE_NEWNS)`, root or CAP_SYS_ADMIN): every filesystem is
   remounted read-only except the working directory, so nothing outside it can be written.
   **network namespace** (`unshare(CLONE_NEWNET)` in the child, needs root or CAP_SYS_ADMIN):
   the command sees only a down loopback device, so no program can reach the network.
2. **unprivileged user** (`run_as`, default `nobody` when running as root and that user can
   execute the interpreter): files outside the sandbox directory are protected by permissions.
3. **rlimits** (always): CPU time (SIGXCPU/SIGKILL), address space (allocation failure), file
   size, open files, no core dumps; own session, so a timeout kills the whole process group.
4. **Python audit hook** (always, for Python children; see :mod:`rlcore.sandbox.guard`): refuses
   sockets, writes outside the sandbox directory, starting programs and ctypes.
5. a clean environment: no proxy variables, HOME inside the sandbox.

The working directory is a fresh temporary directory per run, removed afterwards.
"""

from __future__ import annotations

import ctypes
import os
import pwd
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rlcore.sandbox.base import Limits, Sandbox, SandboxResult, check_relative

_GUARD = Path(__file__).with_name("guard.py")
_CLONE_NEWNET = 0x40000000
_MAX_COLLECT = 256 * 1024  # bytes of files collected back per run


_CLONE_NEWNS = 0x00020000
_MS = {"ro": 1, "nosuid": 2, "nodev": 4, "noexec": 8, "remount": 32, "bind": 4096, "rec": 16384,
       "private": 1 << 18, "relatime": 1 << 21, "noatime": 1024, "nodiratime": 2048}
_WRITABLE_PREFIXES = ("/proc", "/sys", "/dev")


def _unshare_net() -> bool:
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.unshare(_CLONE_NEWNET) == 0


def _readonly_fs(workdir: str) -> bool:
    """In a private mount namespace, remount every mount read-only except `workdir` (bound onto
    itself first) and the kernel filesystems. Per-mount flags (nosuid, nodev, ...) are kept."""
    libc = ctypes.CDLL(None, use_errno=True)
    mount = libc.mount
    if libc.unshare(_CLONE_NEWNS) != 0:
        return False
    if mount(None, b"/", None, _MS["rec"] | _MS["private"], None) != 0:
        return False
    w = workdir.encode()
    if mount(w, w, None, _MS["bind"], None) != 0:
        return False
    with open("/proc/self/mountinfo") as f:
        mounts = [line.split() for line in f]
    for fields in mounts:
        point = fields[4].replace("\\040", " ")
        if point == workdir or point.startswith(_WRITABLE_PREFIXES):
            continue
        flags = _MS["remount"] | _MS["bind"] | _MS["ro"]
        for opt in fields[5].split(","):
            flags |= _MS.get(opt, 0) if opt != "ro" else 0
        if mount(None, point.encode(), None, flags, None) != 0 and point == "/":
            return False  # the root must be read-only; an odd submount that refuses is tolerated
    os.chdir(workdir)  # the cwd was entered before the bind mount: re-enter it through the mount
    return True


def _preexec(limits: Limits, net_namespace: bool, uid: int | None, gid: int | None,
             readonly_root: str | None = None):
    """Runs in the child between fork and exec: limits first, then isolation, then the user."""
    def setup() -> None:
        os.setsid()
        mem = limits.memory_mb * 1024 * 1024
        fsize = limits.file_size_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s + 1))
        resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
        if net_namespace and not _unshare_net():
            os._exit(126)  # promised isolation failed: refuse to run rather than run unisolated
        if readonly_root is not None and not _readonly_fs(readonly_root):
            os._exit(126)
        if uid is not None:
            resource.setrlimit(resource.RLIMIT_NPROC, (limits.max_processes, limits.max_processes))
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
    return setup


def _probe(preexec) -> bool:
    try:
        return subprocess.run([sys.executable, "-c", "pass"], preexec_fn=preexec, timeout=30,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


_CAPS: dict[tuple, bool] = {}


def can_unshare_net() -> bool:
    """Whether this process may give its children their own network namespace (cached)."""
    key = ("net",)
    if key not in _CAPS:
        _CAPS[key] = _probe(_preexec(Limits(), True, None, None))
    return _CAPS[key]


def can_readonly_fs() -> bool:
    """Whether children can get a private mount namespace with a read-only filesystem (cached)."""
    key = ("fs",)
    if key not in _CAPS:
        probe_dir = tempfile.mkdtemp(prefix="rlcore-sandbox-probe-")
        try:
            _CAPS[key] = _probe(_preexec(Limits(), False, None, None, probe_dir))
        finally:
            shutil.rmtree(probe_dir, ignore_errors=True)
    return _CAPS[key]


def can_run_as(user: str) -> bool:
    """Whether children can drop to `user` and still run this interpreter (cached)."""
    key = ("user", user)
    if key not in _CAPS:
        try:
            pw = pwd.getpwnam(user)
            _CAPS[key] = os.geteuid() == 0 and _probe(_preexec(Limits(), False, pw.pw_uid, pw.pw_gid))
        except KeyError:
            _CAPS[key] = False
    return _CAPS[key]


def _reason(returncode: int | None, stderr: str, timed_out: bool) -> str | None:
    if timed_out:
        return "timeout"
    if returncode is None or returncode == 0:
        return None
    if returncode in (-signal.SIGXCPU, -signal.SIGKILL):
        return "cpu_limit" if returncode == -signal.SIGXCPU or "MemoryError" not in stderr else "memory_limit"
    if returncode == -signal.SIGXFSZ:
        return "file_size_limit"
    if "MemoryError" in stderr or "Cannot allocate memory" in stderr or "std::bad_alloc" in stderr:
        return "memory_limit"
    if returncode < 0:
        return f"signal {-returncode}"
    if "PermissionError: sandbox:" in stderr:
        return "sandbox_violation"
    if returncode == 126 and not stderr:
        return "isolation_failed"
    return None


class LocalSandbox(Sandbox):
    """A subprocess sandbox on this machine (see the module docstring for its layers)."""

    def __init__(self, limits: Limits | None = None, network: str = "auto", filesystem: str = "auto",
                 run_as: str | None = "auto"):
        """`network`: `namespace` (required), `auto` (namespace when possible, else the audit hook)
        or `hook` (audit hook only). `filesystem`: `readonly` (required: a private mount namespace
        where everything but the working directory is read-only), `auto` or `hook`. `run_as`: a
        user name, `auto` (`nobody` when possible) or None."""
        self.limits = limits or Limits()
        for key, value, probe in (("network", network, can_unshare_net), ("filesystem", filesystem, can_readonly_fs)):
            strong = "namespace" if key == "network" else "readonly"
            if value not in (strong, "auto", "hook"):
                raise ValueError(f"{key}: choose {strong}, auto or hook, got {value!r}")
            if value == strong and not probe():
                raise RuntimeError(f"sandbox: {key}={strong} is not available here (needs root or CAP_SYS_ADMIN)")
        self.net_namespace = network == "namespace" or (network == "auto" and can_unshare_net())
        self.readonly_fs = filesystem == "readonly" or (filesystem == "auto" and can_readonly_fs())
        self.uid = self.gid = None
        user = "nobody" if run_as == "auto" else run_as
        if user and (run_as != "auto" or can_run_as(user)):
            pw = pwd.getpwnam(user)
            self.uid, self.gid = pw.pw_uid, pw.pw_gid

    @property
    def isolation(self) -> list[str]:
        """The layers this sandbox uses, strongest first."""
        return (["network_namespace"] if self.net_namespace else []) + (
            ["readonly_filesystem"] if self.readonly_fs else []) + (
            ["unprivileged_user"] if self.uid is not None else []) + ["rlimits", "python_audit_hook"]

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
        argv = [sys.executable if i == 0 and a in ("python", "python3") else a for i, a in enumerate(cmd)]
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
            if self.uid is not None:
                os.chmod(base, 0o755)
                for root, dirs, names in os.walk(workdir):
                    for n in [root, *(os.path.join(root, d) for d in dirs), *(os.path.join(root, f) for f in names)]:
                        os.chown(n, self.uid, self.gid)
            out_path, err_path = os.path.join(base, "stdout"), os.path.join(base, "stderr")
            start = time.monotonic()
            timed_out = False
            with open(out_path, "wb") as out, open(err_path, "wb") as err:
                try:
                    proc = subprocess.Popen(argv, cwd=workdir, env=self._env(workdir, guard_dir), stdin=subprocess.DEVNULL,
                                            stdout=out, stderr=err,
                                            preexec_fn=_preexec(self.limits, self.net_namespace, self.uid, self.gid,
                                                                workdir if self.readonly_fs else None))
                except OSError as exc:
                    return SandboxResult(None, "", f"sandbox: cannot start {argv[0]!r}: {exc}", reason="start_failed")
                try:
                    proc.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    timed_out = True
                    os.killpg(proc.pid, signal.SIGKILL)  # the whole session: children too
                    proc.wait()
            duration = time.monotonic() - start
            stdout = Path(out_path).read_bytes()[:_MAX_COLLECT].decode(errors="replace")
            stderr = Path(err_path).read_bytes()[:_MAX_COLLECT].decode(errors="replace")
            return SandboxResult(proc.returncode, stdout, stderr, _reason(proc.returncode, stderr, timed_out),
                                 _collect(workdir), duration)
        finally:
            shutil.rmtree(base, ignore_errors=True)


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
