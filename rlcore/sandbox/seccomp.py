"""The sandbox's syscall filter, compiled by libseccomp (through ctypes) to the BPF bwrap loads.

Default allow; refused with EPERM: every way to a new namespace (unshare, setns, clone with a
CLONE_NEW* flag), mounting (mount, the new mount API, pivot_root, chroot), tracing and reading
other processes (ptrace, process_vm_*, kcmp), the kernel's keyrings (keyctl, add_key,
request_key), bpf, perf_event_open, userfaultfd, io_uring, kernel modules, kexec, swap, reboot,
clock setting, quotactl, acct, file handles (open_by_handle_at), terminal input injection
(ioctl TIOCSTI). clone3 gets ENOSYS: its flags sit in memory a filter cannot read, and libc
falls back to clone, whose flags it can. Calls from another architecture's syscall table
(32-bit x86 on x86_64) kill the process (libseccomp's default for a foreign architecture).

Also refused, as memory no per-process bound sees (issue 41): memfd_create and memfd_secret,
System V shared memory, message queues and semaphores, POSIX message queues (mq_open),
extended attributes (the setxattr family: kernel memory on the work tmpfs that its size does not
count), inotify and fanotify, growing a pipe's or a socket's buffer (fcntl F_SETPIPE_SZ;
SO_SNDBUF, SO_RCVBUF and their FORCE forms), and sockets of any family but AF_UNIX (whose buffers
the supervisor counts; the sandbox has no network anyway), POSIX timers (timer_create: no rlimit
bounds their number) and Linux AIO contexts (io_setup: a host-wide limit). The supervisor alone
may open a netlink sock_diag socket: the command gets a second filter on top
(:func:`command_filter_bpf`) that refuses every netlink socket.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import tempfile

SCMP_ACT_ALLOW = 0x7FFF0000
SCMP_CMP_MASKED_EQ = 7
TIOCSTI = 0x5412
CLONE_NEW = {
    "CLONE_NEWNS": 0x00020000,
    "CLONE_NEWCGROUP": 0x02000000,
    "CLONE_NEWUTS": 0x04000000,
    "CLONE_NEWIPC": 0x08000000,
    "CLONE_NEWUSER": 0x10000000,
    "CLONE_NEWPID": 0x20000000,
    "CLONE_NEWNET": 0x40000000,
    "CLONE_NEWTIME": 0x00000080,
}
REFUSED = (
    "unshare",
    "setns",
    "mount",
    "umount",
    "umount2",
    "pivot_root",
    "chroot",
    "fsopen",
    "fsconfig",
    "fsmount",
    "fspick",
    "move_mount",
    "open_tree",
    "mount_setattr",
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "kcmp",
    "keyctl",
    "add_key",
    "request_key",
    "bpf",
    "perf_event_open",
    "userfaultfd",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "init_module",
    "finit_module",
    "delete_module",
    "kexec_load",
    "kexec_file_load",
    "swapon",
    "swapoff",
    "reboot",
    "settimeofday",
    "clock_settime",
    "clock_adjtime",
    "adjtimex",
    "quotactl",
    "acct",
    "syslog",
    "open_by_handle_at",
    "name_to_handle_at",
    "lookup_dcookie",
    "uselib",
    "vhangup",
    "iopl",
    "ioperm",
    # kernel memory outside every process's resident size (issue 41)
    "memfd_create",
    "memfd_secret",
    "shmget",
    "shmat",
    "msgget",
    "semget",
    "mq_open",
    "setxattr",
    "lsetxattr",
    "fsetxattr",
    "setxattrat",
    "inotify_init",
    "inotify_init1",
    "fanotify_init",
    "timer_create",
    "io_setup",
)
NEWER_SYSCALLS = {"setxattrat": 463}
"""x86_64 numbers of refused calls an older libseccomp may not know by name (same number on
every architecture with the generic table)."""
F_SETPIPE_SZ = 1031
AF_UNIX, AF_NETLINK, NETLINK_SOCK_DIAG = 1, 16, 4
SCMP_CMP_NE, SCMP_CMP_EQ, SCMP_CMP_GT = 1, 4, 6
SOL_SOCKET = 1
SOCKET_BUFFER_OPTIONS = (7, 8, 32, 33)  # SO_SNDBUF, SO_RCVBUF, SO_SNDBUFFORCE, SO_RCVBUFFORCE


class _ArgCmp(ctypes.Structure):
    _fields_ = [
        ("arg", ctypes.c_uint),
        ("op", ctypes.c_int),
        ("datum_a", ctypes.c_uint64),
        ("datum_b", ctypes.c_uint64),
    ]


def _errno_action(code: int) -> int:
    return 0x00050000 | (code & 0xFFFF)


def _library() -> ctypes.CDLL:
    name = ctypes.util.find_library("seccomp") or "libseccomp.so.2"
    try:
        lib = ctypes.CDLL(name, use_errno=True)
    except OSError as exc:
        raise OSError(
            f"the sandbox's syscall filter needs libseccomp ({exc}; on Debian/Ubuntu: apt-get install libseccomp2)"
        ) from None
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add_array.argtypes = [
        ctypes.c_void_p,
        ctypes.c_uint32,
        ctypes.c_int,
        ctypes.c_uint,
        ctypes.POINTER(_ArgCmp),
    ]
    lib.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]
    return lib


def _rule(lib, ctx, action: int, name: str, *cmps: _ArgCmp) -> None:
    nr = lib.seccomp_syscall_resolve_name(name.encode())
    if nr < 0 and os.uname().machine == "x86_64":
        nr = NEWER_SYSCALLS.get(name, nr)
    if nr < 0:
        return  # not a syscall of this architecture (e.g. umount on x86_64)
    array = (_ArgCmp * max(1, len(cmps)))(*cmps)
    rc = lib.seccomp_rule_add_array(ctx, action, nr, len(cmps), array)
    if rc != 0:
        raise OSError(f"libseccomp refused the rule for {name}: {os.strerror(-rc)}")


_BPF: list[bytes] = []


def _sandbox_rules(lib, ctx) -> None:
    eperm = _errno_action(errno.EPERM)
    for name in REFUSED:
        _rule(lib, ctx, eperm, name)
    for flag in CLONE_NEW.values():  # (flags & bit) == bit: any one new namespace refuses the clone
        _rule(lib, ctx, eperm, "clone", _ArgCmp(0, SCMP_CMP_MASKED_EQ, flag, flag))
    _rule(lib, ctx, _errno_action(errno.ENOSYS), "clone3")
    _rule(lib, ctx, eperm, "ioctl", _ArgCmp(1, SCMP_CMP_MASKED_EQ, 0xFFFFFFFF, TIOCSTI))
    _rule(lib, ctx, eperm, "fcntl", _ArgCmp(1, SCMP_CMP_EQ, F_SETPIPE_SZ, 0))
    # sockets: AF_UNIX only, and netlink's sock_diag (how the supervisor counts their buffers)
    for family in range(AF_UNIX + 1, AF_NETLINK):
        _rule(lib, ctx, eperm, "socket", _ArgCmp(0, SCMP_CMP_EQ, family, 0))
    _rule(lib, ctx, eperm, "socket", _ArgCmp(0, SCMP_CMP_GT, AF_NETLINK, 0))
    _rule(
        lib, ctx, eperm, "socket", _ArgCmp(0, SCMP_CMP_EQ, AF_NETLINK, 0), _ArgCmp(2, SCMP_CMP_NE, NETLINK_SOCK_DIAG, 0)
    )
    # a socket's buffers stay at the kernel's default size (what the supervisor assumes a closed
    # socket whose data still waits in its peer's queue holds)
    for option in SOCKET_BUFFER_OPTIONS:
        _rule(lib, ctx, eperm, "setsockopt", _ArgCmp(1, SCMP_CMP_EQ, SOL_SOCKET, 0), _ArgCmp(2, SCMP_CMP_EQ, option, 0))


def _command_rules(lib, ctx) -> None:
    # netlink sockets' queues are not counted: only the supervisor may hold one
    _rule(lib, ctx, _errno_action(errno.EPERM), "socket", _ArgCmp(0, SCMP_CMP_EQ, AF_NETLINK, 0))


def _compile(lib, rules) -> bytes:
    ctx = lib.seccomp_init(SCMP_ACT_ALLOW)
    if not ctx:
        raise OSError("libseccomp could not start a filter")
    try:
        rules(lib, ctx)
        # an unlinked temporary file, not a memfd: a reward worker's own filter refuses memfd_create
        # (memory no bound counts), and the sandbox must still start inside one (mini_swe's tests)
        with tempfile.TemporaryFile(prefix="rlcore-seccomp-") as f:
            rc = lib.seccomp_export_bpf(ctx, f.fileno())
            if rc != 0:
                raise OSError(f"libseccomp could not export the filter: {os.strerror(-rc)}")
            os.lseek(f.fileno(), 0, os.SEEK_SET)
            return os.read(f.fileno(), 1 << 20)
    finally:
        lib.seccomp_release(ctx)


def filter_bpf() -> bytes:
    """The sandbox's filter, bwrap loads it for every process in it (built once per process;
    OSError naming what is missing)."""
    if not _BPF:
        lib = _library()
        _BPF.extend([_compile(lib, _sandbox_rules), _compile(lib, _command_rules)])
    return _BPF[0]


def command_filter_bpf() -> bytes:
    """The filter the supervisor adds, on top, to the command alone (no netlink socket)."""
    filter_bpf()
    return _BPF[1]


def data_fd(data: bytes, name: str) -> int:
    """A readable fd holding `data` from offset 0 (for bwrap's `--seccomp` / `--ro-bind-data`): an
    unlinked temporary file (O_TMPFILE), not a memfd, which a reward worker's filter refuses."""
    fd = os.open(tempfile.gettempdir(), os.O_TMPFILE | os.O_RDWR, 0o600)
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd
