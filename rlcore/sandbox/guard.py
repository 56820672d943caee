"""In-interpreter guard for sandboxed Python: installed as `sitecustomize` in the child.

An audit hook (PEP 578; it cannot be removed once added) refuses network sockets, writes and
deletions outside the sandbox directory, starting other programs and loading native libraries
through ctypes. It is the best-effort layer for Python code: on a machine where the sandbox can
also use a network namespace or an unprivileged user, those stop non-Python code too.

This file is copied verbatim into the child's PYTHONPATH; it must only use the standard library.
The sandbox directory comes from the RLCORE_SANDBOX_ROOT environment variable.
"""

import os
import sys

_ROOT = os.path.realpath(os.environ.get("RLCORE_SANDBOX_ROOT", os.getcwd()))
_ALLOWED_WRITE = ("/dev/null",)
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
_BLOCKED = {
    "socket.connect": "network access is disabled",
    "socket.bind": "network access is disabled",
    "socket.sendto": "network access is disabled",
    "socket.getaddrinfo": "network access is disabled",
    "socket.gethostbyname": "network access is disabled",
    "subprocess.Popen": "starting programs is disabled",
    "os.system": "starting programs is disabled",
    "os.exec": "starting programs is disabled",
    "os.posix_spawn": "starting programs is disabled",
    "os.spawn": "starting programs is disabled",
    "os.fork": "starting programs is disabled",
    "os.forkpty": "starting programs is disabled",
    "os.kill": "signalling processes is disabled",
    "os.killpg": "signalling processes is disabled",
    "ctypes.dlopen": "loading native libraries is disabled",
}
_PATH_EVENTS = {
    "os.remove": 0,
    "os.rmdir": 0,
    "os.mkdir": 0,
    "os.rename": (0, 1),
    "os.truncate": 0,
    "os.chmod": 0,
    "os.chown": 0,
    "os.symlink": (0, 1),
    "os.link": (0, 1),
    "os.utime": 0,
    "shutil.rmtree": 0,
    "shutil.copyfile": 1,
    "shutil.move": 1,
}


def _inside(path) -> bool:
    if isinstance(path, int):  # a file descriptor already opened
        return True
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    real = os.path.realpath(os.fspath(path))
    return real == _ROOT or real.startswith(_ROOT + os.sep) or real in _ALLOWED_WRITE


def _hook(event, args):
    if event in _BLOCKED:
        raise PermissionError(f"sandbox: {_BLOCKED[event]} ({event})")
    if event == "open":
        path, mode, flags = (list(args) + [None, None, None])[:3]
        writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
            isinstance(flags, int) and flags & _WRITE_FLAGS
        )
        if writes and path is not None and not _inside(path):
            raise PermissionError(f"sandbox: write outside the sandbox directory is disabled ({path})")
    elif event in _PATH_EVENTS:
        idx = _PATH_EVENTS[event]
        for i in idx if isinstance(idx, tuple) else (idx,):
            if i < len(args) and args[i] is not None and not _inside(args[i]):
                raise PermissionError(f"sandbox: changing files outside the sandbox directory is disabled ({args[i]})")


sys.addaudithook(_hook)
