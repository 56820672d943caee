"""Each reward call starts from the worker's process state, whatever the previous call changed in
it (issue 41): signal handlers and mask, patched modules (`json`, `os.path`, `builtins`),
`sys.modules` entries, umask, resource limits, `sys.stdout` and file descriptor 1, warnings
filters, the recursion limit. Each reward first checks the state is as the worker started, then
changes it; 16 calls over 2 reused workers score 1.0 only if every call found it clean."""

import builtins
import ctypes
import importlib
import json
import os
import resource
import signal
import subprocess
import sys
import types
import warnings

import pytest

from rlcore.isolation.reward_worker_walls import NOFILE
from tests.test_env_safety import Scored
from tests.test_reward_workers import scored

LIBC = ctypes.CDLL(None)  # looked up before the workers fork: no audit event when a call uses it


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


class Patching(Scored):
    """Every reward checks that `behaviour`'s part of the process is as it started, then changes it."""

    def __init__(self, behaviour, **kw):
        super().__init__(behaviour, **kw)
        # a worker's descriptors are bounded (rlcore.isolation.reward_worker_walls.NOFILE)
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        want = NOFILE if hard == resource.RLIM_INFINITY else min(NOFILE, hard)
        self.umask, self.nofile = _umask(), (want, want)
        self.recursion = sys.getrecursionlimit()

    def reward(self, task, completion):
        b = self.behaviour
        if b == "signal_handlers":  # SIGUSR1 ignored would also stop the actor abandoning later calls
            clean = signal.getsignal(signal.SIGTERM) == signal.SIG_DFL and signal.getsignal(signal.SIGUSR1) not in (
                signal.SIG_IGN,
                signal.SIG_DFL,
            )
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        elif b == "signal_mask":
            clean = signal.SIGUSR1 not in signal.pthread_sigmask(signal.SIG_BLOCK, [])
            signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGUSR1])
        elif b == "patch_json":
            clean = json.dumps([1]) == "[1]"
            json.dumps = lambda *a, **k: "patched"
        elif b == "patch_os_path":
            clean = os.path.join("a", "b") == "a/b"
            os.path.join = lambda *a: "patched"
        elif b == "patch_builtins":
            clean = len("ab") == 2
            builtins.len = lambda x: 0
        elif b == "replace_module":
            clean = hasattr(importlib.import_module("json"), "dumps")
            sys.modules["json"] = types.ModuleType("json")
        elif b == "umask":
            clean = os.umask(0o777) == self.umask
        elif b == "rlimit":
            clean = resource.getrlimit(resource.RLIMIT_NOFILE) == self.nofile
            resource.setrlimit(resource.RLIMIT_NOFILE, (64, self.nofile[1]))
        elif b == "rlimit_by_child":  # not through Python's resource module: from a child process
            clean = resource.getrlimit(resource.RLIMIT_NOFILE) == self.nofile
            subprocess.run(["prlimit", f"--pid={os.getpid()}", f"--nofile=64:{self.nofile[1]}"], check=True)
        elif b == "rlimit_by_ctypes":  # nor through Python: libc directly
            clean = resource.getrlimit(resource.RLIMIT_NOFILE) == self.nofile
            limit = (ctypes.c_ulong * 2)(64, self.nofile[1])
            assert LIBC.setrlimit(resource.RLIMIT_NOFILE, limit) == 0
        elif b == "stdout":
            clean = (
                getattr(sys.__stdout__, "name", None) == "<stdout>"
                and os.fstat(1).st_rdev == os.stat(os.devnull).st_rdev
            )
            sys.__stdout__ = sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (kept open on purpose)
            os.dup2(os.open("/proc/self/stat", os.O_RDONLY), 1)
        elif b == "warnings":
            clean = not any(f[0] == "error" for f in warnings.filters)
            warnings.simplefilter("error")
        elif b == "recursion_limit":
            clean = sys.getrecursionlimit() == self.recursion
            sys.setrecursionlimit(self.recursion + 1000)
        else:
            raise AssertionError(b)
        return 1.0 if clean else 0.0


@pytest.mark.parametrize(
    "behaviour",
    [
        "signal_handlers",
        "signal_mask",
        "patch_json",
        "patch_os_path",
        "patch_builtins",
        "replace_module",
        "umask",
        "rlimit",
        "rlimit_by_child",
        "rlimit_by_ctypes",
        "stdout",
        "warnings",
        "recursion_limit",
    ],
)
def test_each_call_starts_from_the_process_state_the_worker_started_with(behaviour):
    env = Patching(behaviour)
    try:
        assert [s.reward for s in scored(env, tasks=2, n=8)] == [1.0] * 16  # 16 calls, 2 workers, reused
        assert [s.reward for s in scored(env, tasks=2, n=8)] == [1.0] * 16  # and the next request's
    finally:
        env.reward_pool().close()
    assert json.dumps([1]) == "[1]" and len("ab") == 2 and os.path.join("a", "b") == "a/b"
