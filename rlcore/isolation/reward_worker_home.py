"""The process state each reward call in a worker starts from, restored after every call.

:class:`Home` takes the state when the worker starts; after each call :meth:`Home.restore` puts
back what the call changed: the working directory, `os.environ`, `sys.path`, `sys.meta_path`,
`sys.path_hooks`, `warnings.filters`, a pending alarm, signal handlers (not real-time signals')
and the signal mask, the umask, resource limits, file descriptors 0-2, `sys.modules` entries replaced or removed, the
tracing and profiling hooks, the recursion limit, the switch interval, the int-to-str digit limit,
the garbage collector's switch, and every attribute a call set or deleted on a module (`json.loads
= ...`, `os.path.join = ...`, `sys.stdout = ...`, `builtins.open = ...`).

Module attributes are journaled, not compared (comparing every module's namespace costs about a
millisecond a call with torch loaded): each plain module's class becomes :class:`_Journaled`,
whose `__setattr__`/`__delattr__` note the old value while a call runs. Writes that bypass
attribute assignment (`vars(m)[k] = v`, `global` statements in the module's own functions) and
attributes of classes (a patched method) are not restored; a module a call imports first stays
for later calls, as it would in a thread. A resource limit a call lowered below what an
unprivileged process may raise again cannot be restored: the worker then retires.
"""

from __future__ import annotations

import _signal
import gc
import os
import resource
import signal
import sys
import types
import warnings

_MISSING = object()
_journal: list[tuple[types.ModuleType, str, object]] = []
_recording = [False]
LIMITS = [getattr(resource, n) for n in dir(resource) if n.startswith("RLIMIT_")]
HANDLED = sorted(s for s in signal.valid_signals() if s < signal.SIGRTMIN and s not in (signal.SIGKILL, signal.SIGSTOP))
"""Signals whose handlers are put back (read through `_signal`: `signal.getsignal` converts each
to an enum, 17 us a call for all of them against 0.5)."""


class _Journaled(types.ModuleType):
    """A module whose attribute writes during a call are noted, so they can be undone."""

    def __setattr__(self, name: str, value) -> None:
        if _recording[0]:
            _journal.append((self, name, self.__dict__.get(name, _MISSING)))
        super().__setattr__(name, value)

    def __delattr__(self, name: str) -> None:
        if _recording[0]:
            _journal.append((self, name, self.__dict__.get(name, _MISSING)))
        super().__delattr__(name)


def _journal_modules(modules) -> None:
    for module in modules:
        if type(module) is types.ModuleType:  # lazy and custom module classes keep their own
            try:
                module.__class__ = _Journaled
            except TypeError:
                pass


class recording:
    """`with recording():` around a call: the module attributes it sets are journaled."""

    def __enter__(self):
        _recording[0] = True

    def __exit__(self, *exc):
        _recording[0] = False


class Home:
    """The process state every call starts from (taken when the worker starts)."""

    def __init__(self):
        self.cwd = os.getcwd()
        self.environ = dict(os.environ)
        self.raw_environ = dict(_raw(os.environ))
        self.lists = [(lst, list(lst)) for lst in (sys.path, sys.meta_path, sys.path_hooks, warnings.filters)]
        self.modules = dict(sys.modules)
        self.module_list = list(self.modules.values())
        self.umask = os.umask(0o022)
        os.umask(self.umask)
        self.limits = list(map(resource.getrlimit, LIMITS))
        self.handlers = list(map(_signal.getsignal, HANDLED))
        self.mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])
        self.fds = {fd: _identity(fd) for fd in (0, 1, 2)}
        self.interpreter = _interpreter()
        _journal_modules(list(sys.modules.values()))

    def restore(self) -> str | None:
        """Put back what the last call changed; a reason to retire the worker, if one remains."""
        signal.alarm(0)  # an alarm a call set would kill a later call
        _undo_journal()
        try:
            moved = os.getcwd() != self.cwd
        except OSError:  # its directory was removed
            moved = True
        if moved:
            os.chdir(self.cwd)
        if _raw(os.environ) != self.raw_environ:  # the encoded mapping: 1 us where decoding all is 80
            os.environ.clear()
            os.environ.update(self.environ)
        for lst, saved in self.lists:
            if lst != saved:
                lst[:] = saved
                if lst is warnings.filters:
                    warnings._filters_mutated()
        # in order, by identity: 3x cheaper than comparing the mappings (a replaced entry keeps its place)
        if len(sys.modules) != len(self.module_list) or list(sys.modules.values()) != self.module_list:
            self._restore_modules()
        os.umask(self.umask)
        if list(map(_signal.getsignal, HANDLED)) != self.handlers:
            for s, handler in zip(HANDLED, self.handlers):
                if _signal.getsignal(s) is not handler:
                    try:
                        _signal.signal(s, signal.SIG_DFL if handler is None else handler)
                    except (OSError, ValueError):  # one Python may not set (libc's own): as it was
                        pass
        signal.pthread_sigmask(signal.SIG_SETMASK, self.mask)
        self._restore_fds()
        if _interpreter() != self.interpreter:
            _set_interpreter(self.interpreter)
        sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
        return self._restore_limits()

    def _restore_modules(self) -> None:
        for name, module in self.modules.items():
            if sys.modules.get(name) is not module:
                sys.modules[name] = module
        added = [m for name, m in sys.modules.items() if name not in self.modules]
        _journal_modules(added)  # imported by a call: kept, and journaled from now on
        self.modules = dict(sys.modules)
        self.module_list = list(self.modules.values())

    def _restore_fds(self) -> None:
        for fd, ident in self.fds.items():
            if _identity(fd) != ident:
                target = os.open(os.devnull, os.O_RDWR)  # what the worker gives 0-2
                os.dup2(target, fd)
                os.close(target)

    def _restore_limits(self) -> str | None:
        if list(map(resource.getrlimit, LIMITS)) == self.limits:
            return None
        for r, saved in zip(LIMITS, self.limits):
            if resource.getrlimit(r) != saved:
                try:
                    resource.setrlimit(r, saved)
                except (ValueError, OSError) as exc:
                    return f"the reward lowered a resource limit the worker cannot raise again ({exc})"
        return None


def _undo_journal() -> None:
    while _journal:
        module, name, old = _journal.pop()
        if old is _MISSING:
            new = module.__dict__.get(name, _MISSING)
            if isinstance(new, types.ModuleType) and sys.modules.get(f"{module.__name__}.{name}") is new:
                continue  # a submodule bound by its import: it stays imported
            module.__dict__.pop(name, None)
        else:
            module.__dict__[name] = old


def _identity(fd: int):
    try:
        st = os.fstat(fd)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_rdev


def _interpreter() -> tuple:
    return (
        sys.gettrace(),
        sys.getprofile(),
        sys.getrecursionlimit(),
        sys.getswitchinterval(),
        sys.get_int_max_str_digits(),
        gc.isenabled(),
    )


def _set_interpreter(state: tuple) -> None:
    trace, profile, recursion, switch, digits, collecting = state
    sys.settrace(trace)
    sys.setprofile(profile)
    sys.setrecursionlimit(recursion)
    sys.setswitchinterval(switch)
    sys.set_int_max_str_digits(digits)
    (gc.enable if collecting else gc.disable)()


def _raw(environ) -> dict:
    return getattr(environ, "_data", environ)
