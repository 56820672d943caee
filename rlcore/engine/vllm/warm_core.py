"""vLLM's engine core started from a warm process instead of a fresh interpreter.

`AsyncLLM` runs its engine core in a child process. Inside a Ray actor vLLM must not fork the
actor (its gRPC threads), so it spawns: a new interpreter that imports torch and vLLM again, about
14 s on an H100 machine after the actor spent as long importing them itself, one after the other
(the warm start of `+recipe=reverse_text_smollm2`: 36.7 s of engine start, 5.3 s of it vLLM's own
init). Here the actor starts Python's `forkserver` first thing, with vLLM's engine core modules as
its preload, so that import runs while the actor imports and plans; the engine core is then forked
from that server, which is single-threaded and has never touched CUDA (the case vLLM's own
default `fork` method is built for).

A forked child would otherwise start with the server's environment and working directory, frozen
when the actor started it: each engine-core process takes the actor's `os.environ` and cwd as
they are when vLLM starts it (vLLM sets variables for its child just before). It dies with the
server (`PR_SET_PDEATHSIG`), and the server exits when the actor's end of its pipe closes, so a
killed actor leaves no engine core holding the GPU.

Only the multiprocessing context of vLLM's engine-core launcher changes (`get_mp_context` in
`vllm.v1.engine.utils`), and only where vLLM would spawn; everything else is vLLM's own code.
`rollout.vllm.warm_engine_core=false` keeps vLLM's spawn.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import multiprocessing.context
import multiprocessing.forkserver
import os
import signal
import threading

log = logging.getLogger(__name__)

PRELOAD = (
    "vllm.v1.engine.core",
    "vllm.v1.executor.uniproc_executor",
    "vllm.v1.worker.gpu_worker",
    "rlcore.engine.vllm.vllm_worker",
)
"""Modules the server imports before its first fork: what the engine core imports to start
(a module missing from this vLLM version is skipped by the server)."""
PR_SET_PDEATHSIG = 1

_lock = threading.Lock()
_started = False


class InheritingProcess(multiprocessing.context.ForkServerProcess):
    """A forkserver child that runs with its starter's environment and working directory as
    they were at `start()`, and dies with the server that forked it."""

    def start(self) -> None:
        self._starter_env = dict(os.environ)
        self._starter_cwd = os.getcwd()
        multiprocessing.forkserver.ensure_running()
        self._server_pid = server_pid()
        super().start()

    def run(self) -> None:
        # The server hands each child its own end of the pipe that keeps the server alive, so it
        # outlives its starter while any child lives: closed here, the server exits with the
        # starter (the actor), and this process with the server (below).
        server = multiprocessing.forkserver._forkserver
        alive = getattr(server, "_forkserver_alive_fd", None)
        if alive is not None:
            os.close(alive)
            server._forkserver_alive_fd = None
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != self._server_pid:  # the server ended between the fork and the line above
            os._exit(1)
        os.environ.clear()
        os.environ.update(self._starter_env)
        try:
            os.chdir(self._starter_cwd)
        except OSError:
            pass
        super().run()


class WarmContext(multiprocessing.context.ForkServerContext):
    """The forkserver context whose processes are :class:`InheritingProcess`."""

    Process = InheritingProcess


CONTEXT = WarmContext()


def start(preload: tuple[str, ...] = PRELOAD) -> None:
    """Start this process's forkserver with `preload` imported in it (returns at once: the
    imports run in the server while this process goes on). Once per process."""
    global _started
    with _lock:
        if _started:
            return
        multiprocessing.set_forkserver_preload(list(preload))
        multiprocessing.forkserver.ensure_running()
        _started = True


def prestart(options) -> None:
    """The vLLM engine's early start (`EngineSpec.prestart`): the warm server, unless its section
    (`rollout.vllm`, a `VLLMOptions`) sets `warm_engine_core` false."""
    if getattr(options, "warm_engine_core", True):
        start()


def server_pid() -> int | None:
    """The pid of this process's forkserver (None before it started)."""
    return getattr(multiprocessing.forkserver._forkserver, "_forkserver_pid", None)


def started() -> bool:
    """Whether :func:`start` ran in this process."""
    return _started


def use_for_vllm() -> bool:
    """Make vLLM's engine-core launcher fork from the warm server wherever it would spawn.
    Needs :func:`start` first; returns False (vLLM unchanged) where this vLLM has no such
    launcher. Idempotent."""
    if not _started:
        return False
    try:
        import vllm.v1.engine.utils as launcher
    except ImportError:
        return False
    original = getattr(launcher, "get_mp_context", None)
    if original is None:
        return False
    if getattr(original, "_rlcore_warm", False):
        return True

    def get_mp_context():
        ctx = original()  # vLLM's own checks and environment first
        return CONTEXT if ctx.get_start_method() == "spawn" else ctx

    get_mp_context._rlcore_warm = True  # type: ignore[attr-defined]
    launcher.get_mp_context = get_mp_context
    log.info("vLLM engine core: forked from a warm server (rollout.vllm.warm_engine_core)")
    return True
