"""The sandbox interface: run a command over a set of files, isolated, with limits.

A sandbox is stateless from the caller's side: every `run` gets the complete file set it needs,
in a fresh working directory, and returns what the command printed plus the files it left there.
That keeps environments (which hold their files in episode state) independent of where code
runs: :class:`rlcore.sandbox.local.LocalSandbox` on this machine, a container runtime on a
cluster (implement `run` with the same contract and pass it to the environment).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from pathlib import PurePosixPath


@dataclass
class Limits:
    """Resource limits of one run."""

    timeout_s: float = 10.0
    """Wall-clock limit; the whole process group is killed when it passes."""
    cpu_s: int = 10
    """CPU-time limit (seconds), enforced by the kernel (SIGXCPU, then SIGKILL)."""
    memory_mb: int = 1024
    """Memory limit (MiB): each process's address space (allocations beyond it fail: MemoryError in
    Python) and the resident memory of the whole process tree together with its AF_UNIX socket
    buffers (the tree is killed); memory no process's size shows (memfd, shared memory, xattrs)
    is refused by the syscall filter."""
    file_size_mb: int = 16
    """Largest file (and captured stdout/stderr) the command may write (MiB)."""
    max_processes: int = 64
    """Process limit (RLIMIT_NPROC) of the whole sandbox."""
    disk_mb: int = 100
    """Disk quota of the work directory (MiB), every file together; writes past it fail (ENOSPC)."""
    max_files: int = 10_000
    """Most files, directories and links the command may add to the work directory (each holds
    kernel memory no disk quota counts); past it the tree is killed (`work_dir_limit`)."""


@dataclass
class SandboxResult:
    """What one run did. `reason` says why it was stopped, or is None if it exited by itself."""

    returncode: int | None
    stdout: str
    stderr: str
    reason: str | None = None
    """`timeout`, `cpu_limit`, `memory_limit`, `file_size_limit`, `disk_quota`, `work_dir_limit` (too
    many files, or a tree too deep, left in the work directory: `files` holds part of it),
    `sandbox_violation` (something refused, e.g. a system call the filter forbids),
    `isolation_failed` (the sandbox itself failed, never the command's doing), `signal N` (a signal
    no limit sent, e.g. `kill -9 -1` inside) or None."""
    files: dict[str, str] = field(default_factory=dict)
    """Text files under the working directory after the run (relative path -> content)."""
    duration_s: float = 0.0
    violations: list[str] = field(default_factory=list)
    """Escape attempts seen (one line each); non-empty means `reason` is `sandbox_violation`
    unless a limit or the timeout stopped the run first."""

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.reason is None


def check_relative(path: str) -> str:
    """A normalised relative path inside the sandbox, or ValueError (absolute, `..`, empty)."""
    p = PurePosixPath(path)
    if not path or p.is_absolute() or ".." in p.parts:
        raise ValueError(f"path must be relative and stay inside the sandbox: {path!r}")
    return str(p)


class Sandbox(abc.ABC):
    """Runs untrusted commands."""

    @abc.abstractmethod
    def run(self, cmd: list[str], files: dict[str, str] | None = None, timeout: float | None = None) -> SandboxResult:
        """Run `cmd` (argv; `python` means the sandbox's Python interpreter) in a fresh working
        directory holding `files` (relative path -> text). `timeout` overrides the wall-clock
        limit. Never raises for the command's faults: they are in the result."""
