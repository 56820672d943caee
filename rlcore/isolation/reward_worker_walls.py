"""What a reward worker is kept from (issue 54): the run's descriptors, the cluster's files and
addresses, memory no per-process bound counts, and a worker state that later calls would meet.

- Descriptors: a keeper closes every descriptor but its pipe and progress (:func:`close_fds_but`:
  a fork of the actor would hold other workers' pipes and Ray's sockets); the worker's
  RLIMIT_NOFILE is bounded (`NOFILE`), and what a call opens closes with the call's process.
- The cluster: Ray's variables and tokens leave the worker's environment (:func:`scrub_environment`);
  in a mount namespace (root, or an ordinary uid with user namespaces) Ray's session directories,
  `~/.ray` and the token file are hidden and /dev/shm is a tmpfs of its own bounded by
  `env.reward.memory_mb` (:func:`hide_cluster`). The network namespace is :mod:`reward_worker_ns`'s.
- Memory: a seccomp filter (:func:`refuse_unbounded_memory`) refuses memfd_create, memfd_secret,
  System V shared memory, semaphores and message queues, POSIX message queues, shared anonymous
  mappings, growing a pipe's buffer, and (without `env.reward.network`) sockets of any family but
  AF_UNIX and netlink (the worker's own network namespace), and `setns` (back into the host's namespaces). Not refused: new namespaces and mounts,
  so a reward can still run the sandbox (and a root reward can unmount what hides Ray's files).
- State: each call runs in a process of its own, forked from the worker
  (:func:`rlcore.isolation.reward_worker_loop.run_forked`); the worker's own memory is out of its
  reach (:func:`keep_calls_out_of_the_worker`, and ptrace refused by the filter).
"""

from __future__ import annotations

import ctypes
import errno
import os
import resource
import sys

NOFILE = 4096
"""The worker's descriptor limit (soft and hard, where the hard limit allows)."""
KEEP_ENV = (
    "PATH",
    "HOME",
    "LANG",
    "LANGUAGE",
    "TERM",
    "TZ",
    "TMPDIR",
    "USER",
    "LOGNAME",
    "SHELL",
    "PWD",
    "VIRTUAL_ENV",
    "CONDA_PREFIX",
    "SSL_CERT_FILE",
    "SSL_CERT_DIR",
    "REQUESTS_CA_BUNDLE",
)
"""Variables kept whatever their name (with every LC_*, PYTHON*, OMP_*, MKL_*, HF_HOME/TRANSFORMERS_* paths)."""
SECRET_WORDS = ("TOKEN", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL", "API_KEY", "ACCESS_KEY", "PRIVATE_KEY")
"""Variables whose name holds one of these leave unless the environment's `env.reward.network` is true
(a judge reached over the network needs its key)."""
MS_REC, MS_PRIVATE, MS_BIND, MS_RDONLY, MS_NOSUID, MS_NODEV = 0x4000, 1 << 18, 0x1000, 1, 2, 4


def close_fds_but(keep: set[int]) -> None:
    """Close every descriptor of this process not in `keep`."""
    for fd in map(int, os.listdir("/proc/self/fd")):
        if fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass


def cluster_variable(name: str, network: bool) -> bool:
    """Whether the worker must not see variable `name`."""
    upper = name.upper()
    if upper.startswith(("RAY_", "RAYLET", "ANYSCALE", "KUBERAY", "RLCORE_RAY")) or upper in ("REDIS_PASSWORD",):
        return True
    if upper in KEEP_ENV or upper.startswith(("LC_", "PYTHON")):
        return False
    return not network and any(w in upper for w in SECRET_WORDS)


def scrub_environment(network: bool) -> None:
    """Remove the cluster's variables (and, without network, secrets) from this process's environment."""
    for name in [n for n in os.environ if cluster_variable(n, network)]:
        os.environ.pop(name, None)


def _ray_dirs() -> list[str]:
    roots = {"/tmp/ray"}
    for name in ("RAY_TMPDIR", "TMPDIR"):
        base = os.environ.get(name)
        if base and name == "RAY_TMPDIR":
            roots.add(os.path.join(base, "ray"))
    return sorted(r for r in roots if os.path.isdir(r))


def hide_cluster(memory_mb: int) -> list[str]:
    """In this process's own mount namespace (`reward_worker_ns.entered`): hide Ray's session
    directories (an empty tmpfs over each; only their sockets and logs where the worker's working
    directory or sys.path lies inside), `~/.ray` and the file `RAY_AUTH_TOKEN_PATH` names, and give
    /dev/shm a tmpfs of its own bounded by `memory_mb`. Returns what it hid; nothing without a
    mount namespace."""
    from rlcore.isolation import reward_worker_ns as ns

    if "mount" not in ns.entered:
        return []
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_ulong, ctypes.c_char_p]
    if libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None) != 0:  # nothing here reaches the host
        return []

    def over(path: str, size: str = "64k") -> bool:
        opts = f"size={size},mode=0755".encode()
        return libc.mount(b"tmpfs", path.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, opts) == 0

    hidden = []
    used = [os.getcwd(), *(p for p in sys.path if p)]
    for root in _ray_dirs():
        if not any(os.path.abspath(p).startswith(root + os.sep) for p in used):
            if over(root):
                hidden.append(root)
            continue
        for name in os.listdir(root):
            for sub in ("sockets", "logs"):
                path = os.path.join(root, name, sub)
                if name.startswith("session") and os.path.isdir(path) and over(path):
                    hidden.append(path)
    home = os.path.expanduser("~/.ray")
    if os.path.isdir(home) and over(home):
        hidden.append(home)
    token = os.environ.get("RAY_AUTH_TOKEN_PATH")
    if token and os.path.isfile(token):
        if libc.mount(b"/dev/null", token.encode(), None, MS_BIND, None) == 0:
            hidden.append(token)
    if os.path.isdir("/dev/shm") and over("/dev/shm", f"{max(1, memory_mb) if memory_mb > 0 else 64}m"):
        hidden.append("/dev/shm")
    return hidden


def limit_descriptors() -> None:
    """Bound this process's descriptors to `NOFILE` (or less, where the hard limit is lower)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = NOFILE if hard == resource.RLIM_INFINITY else min(NOFILE, hard)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, want))
    except (ValueError, OSError):
        pass


PR_SET_DUMPABLE, PR_CAPBSET_DROP, CAP_SYS_PTRACE = 4, 24, 19
_LINUX_CAPABILITY_VERSION_3 = 0x20080522


def keep_calls_out_of_the_worker() -> None:
    """Make this process's memory unreachable from the processes it forks for its calls: not
    dumpable (its /proc files need CAP_SYS_PTRACE) and without CAP_SYS_PTRACE (its children have
    it neither: /proc/<worker>/mem stays closed to a root reward). ptrace itself is refused by the
    worker's filter. Best effort where the process lacks the right to drop a capability."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    libc.prctl(PR_CAPBSET_DROP, CAP_SYS_PTRACE, 0, 0, 0)
    header = (ctypes.c_uint32 * 2)(_LINUX_CAPABILITY_VERSION_3, 0)
    data = (ctypes.c_uint32 * 6)()
    if libc.capget(header, data) == 0:
        for i in (0, 1, 2):  # effective, permitted, inheritable (low words)
            data[i] &= ~(1 << CAP_SYS_PTRACE) & 0xFFFFFFFF
        libc.capset(header, data)


# seccomp, as the sandbox builds it (rlcore.sandbox.seccomp), for the worker itself
SECCOMP_SET_MODE_FILTER, PR_SET_NO_NEW_PRIVS = 1, 38
MAP_SHARED, MAP_ANONYMOUS = 0x01, 0x20
MEMORY_REFUSED = ("memfd_create", "memfd_secret", "shmget", "shmat", "msgget", "semget", "mq_open")
WALL_REFUSED = ("setns", "ptrace", "process_vm_writev", "process_vm_readv")
"""Refused too: re-entering the host's namespaces through /proc/<pid>/ns (a root reward could), and
reaching another process's memory (the worker's, from a call's process)."""
_FILTERS: dict[bool, bytes] = {}


def _worker_rules(network: bool):
    from rlcore.sandbox import seccomp as sc

    def rules(lib, ctx) -> None:
        eperm = sc._errno_action(errno.EPERM)
        for name in MEMORY_REFUSED + WALL_REFUSED:
            sc._rule(lib, ctx, eperm, name)
        flags = MAP_SHARED | MAP_ANONYMOUS
        sc._rule(lib, ctx, eperm, "mmap", sc._ArgCmp(3, sc.SCMP_CMP_MASKED_EQ, flags, flags))
        sc._rule(lib, ctx, eperm, "fcntl", sc._ArgCmp(1, sc.SCMP_CMP_EQ, sc.F_SETPIPE_SZ, 0))
        if not network:
            # AF_UNIX (its peers are the worker's own: the cluster's sockets are hidden) and netlink
            # (the worker's own network namespace: the sandbox's bwrap sets its loopback up through
            # it, and mini_swe's reward runs the sandbox) only; every other family is refused
            for call in ("socket", "socketpair"):
                for family in range(sc.AF_UNIX + 1, sc.AF_NETLINK):
                    sc._rule(lib, ctx, eperm, call, sc._ArgCmp(0, sc.SCMP_CMP_EQ, family, 0))
                sc._rule(lib, ctx, eperm, call, sc._ArgCmp(0, sc.SCMP_CMP_GT, sc.AF_NETLINK, 0))

    return rules


def worker_filter(network: bool) -> bytes:
    """The worker's BPF program (built once per process, before the worker forks)."""
    if network not in _FILTERS:
        from rlcore.sandbox import seccomp as sc

        _FILTERS[network] = sc._compile(sc._library(), _worker_rules(network))
    return _FILTERS[network]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def refuse_unbounded_memory(network: bool) -> str | None:
    """Load the worker's filter into this process (and every process it starts); why not, if it
    could not be (libseccomp missing: the worker then runs without it)."""
    try:
        program = worker_filter(network)
    except OSError as exc:
        return str(exc)
    libc = ctypes.CDLL(None, use_errno=True)
    buf = ctypes.create_string_buffer(program, len(program))
    prog = _SockFprog(len(program) // 8, ctypes.cast(buf, ctypes.c_void_p))
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        return f"prctl(NO_NEW_PRIVS): {os.strerror(ctypes.get_errno())}"
    libc.syscall.restype = ctypes.c_long
    nr = {"x86_64": 317, "aarch64": 277}.get(os.uname().machine)
    if nr is None:
        return "seccomp: unknown architecture"
    if (
        libc.syscall(ctypes.c_long(nr), ctypes.c_ulong(SECCOMP_SET_MODE_FILTER), ctypes.c_ulong(0), ctypes.byref(prog))
        != 0
    ):
        return f"seccomp: {os.strerror(ctypes.get_errno())}"
    return None
