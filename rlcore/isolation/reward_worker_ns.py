"""The reward worker's own PID namespace: a reward cannot name the rollout actor, the keeper or any
other process of the run, so it cannot signal them (`os.kill` of their pids, `kill(-1)`,
`killpg`, pidfds) nor trace them by pid.

The keeper enters the namespace (:func:`enter`) before it forks the worker, so the worker is the
namespace's init (pid 1): a call's `os.getppid()` is 0, `kill(-1)` reaches only the worker's
own descendants, signals from inside the namespace that the worker does not handle (SIGKILL
included) do not reach it, and when it dies the kernel kills everything in the namespace. The
worker heads a session of its own, so `killpg(0)` reaches only it.

As an ordinary uid the namespace needs a user namespace too (the caller's uid and gid mapped to
themselves). Root keeps host root (a reward may run the sandbox, whose root mode needs it): a
root reward that deliberately re-enters the host's namespace (`setns`, CAP_SYS_ADMIN) is not
contained. `/proc` stays the host's: the worker reads its host pid there.
"""

from __future__ import annotations

import ctypes
import os
import signal
import time
from collections.abc import Callable, Iterable

CLONE_NEWUSER, CLONE_NEWPID = 0x10000000, 0x20000000
CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWNET = 0x00020000, 0x08000000, 0x40000000
WALLS = {"mount": CLONE_NEWNS, "ipc": CLONE_NEWIPC, "net": CLONE_NEWNET}
"""Namespaces the worker gets besides its PID namespace where the kernel allows: a mount namespace
(:mod:`rlcore.isolation.reward_worker_walls` hides the cluster's files there), an IPC namespace
(SysV objects die with it), a network namespace with no interface up (no network; not when the
environment's `env.reward.network` is true)."""
entered: set[str] = set()
"""Which of `WALLS` this process got from :func:`enter`."""
NONE, PID, USER_AND_PID = 0, 1, 2
"""What :func:`enter` achieved: nothing (the worker shares the actor's PID namespace), a PID
namespace (root), a user and a PID namespace (an ordinary uid)."""


def enter(network: bool = True) -> int:
    """Put this process's future children in a new PID namespace; returns NONE, PID or
    USER_AND_PID. Also the namespaces of `WALLS` (no network namespace when `network`), each
    where the kernel allows (`entered` says which). Call in a single-threaded process (a fresh fork)."""
    libc = ctypes.CDLL(None, use_errno=True)
    walls = {k: v for k, v in WALLS.items() if network is False or k != "net"}
    extra = sum(walls.values())
    entered.clear()
    if os.geteuid() == 0:
        if libc.unshare(CLONE_NEWPID | extra) == 0:
            entered.update(walls)
            return PID
        return PID if libc.unshare(CLONE_NEWPID) == 0 else NONE
    uid, gid = os.geteuid(), os.getegid()
    if libc.unshare(CLONE_NEWUSER | CLONE_NEWPID | extra) == 0:
        entered.update(walls)
    elif libc.unshare(CLONE_NEWUSER | CLONE_NEWPID) != 0:
        return NONE
    # an unprivileged process may map its own uid and gid (after refusing setgroups) and nothing else
    for path, text in (
        ("/proc/self/setgroups", "deny"),
        ("/proc/self/uid_map", f"{uid} {uid} 1"),
        ("/proc/self/gid_map", f"{gid} {gid} 1"),
    ):
        try:
            with open(path, "w") as f:
                f.write(text)
        except OSError:
            pass  # an old kernel without setgroups: the maps are written regardless
    return USER_AND_PID


def host_pid() -> int:
    """This process's pid as the actor sees it (in a namespace of its own `os.getpid()` is 1)."""
    return int(os.readlink("/proc/self"))


def host_ppid() -> int:
    """The parent's pid as the actor sees it (0 from a namespace's init through `os.getppid()`)."""
    with open("/proc/self/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def kill_and_reap(window_s: float, targets: Callable[[], Iterable[int]]) -> bool:
    """Reap this process's ended children and SIGKILL `targets()` (pids; -1 from a namespace's
    init: every other member, in any session or nested namespace) until none is left. False if
    they outran `window_s` (a fork bomb)."""
    deadline = time.monotonic() + window_s
    while time.monotonic() < deadline:
        try:
            while os.waitpid(-1, os.WNOHANG)[0] > 0:  # reap what already ended
                pass
        except ChildProcessError:
            return True  # none left (the common case: one syscall)
        for pid in targets():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.001)  # killed children turn zombie; their orphans are re-parented to us
    return False
