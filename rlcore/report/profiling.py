"""Recording one process's part of a run's timeline (`profile.steps`): torch.profiler traces
handed back as bytes, so the driver gathers them from every node into `{output_dir}/profile`
whatever the processes' own disks are (`rlcore.report.timeline` reads them).

A trace is a Chrome trace of Kineto (`torch.profiler`): event times are microseconds after the
trace's `baseTimeNanoseconds`, on the host's wall clock, so traces of several processes on one
host line up without any clock exchange (processes on different hosts line up as far as their
clocks agree).
"""

from __future__ import annotations

import os
import socket
import tempfile
from pathlib import Path
from typing import Any

TRACE_SUFFIXES = (".json", ".json.gz")


def source_info(name: str, role: str) -> dict[str, Any]:
    """What the timeline needs to know of a traced process: its `name`, its `role` (`trainer` or
    `engine`), its host, and the physical GPUs its CUDA devices 0, 1, ... are (from
    CUDA_VISIBLE_DEVICES; empty when it sees none or the variable is unset)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    gpus = [g.strip() for g in visible.split(",") if g.strip()]
    return {"name": name, "role": role, "host": socket.gethostname(), "gpus": gpus}


def trace_files(folder: str | Path) -> list[Path]:
    """The Chrome trace files in `folder` (any depth), oldest first."""
    found = [p for p in Path(folder).rglob("*") if p.is_file() and p.name.endswith(TRACE_SUFFIXES)]
    return sorted(found, key=lambda p: (p.stat().st_mtime_ns, p.name))


def read_new(folder: str | Path, seen: set[str]) -> list[tuple[str, bytes]]:
    """(file name, bytes) of the trace files in `folder` not in `seen` (which gains them)."""
    out = []
    for path in trace_files(folder):
        key = str(path)
        if key not in seen:
            seen.add(key)
            out.append((path.name, path.read_bytes()))
    return out


def _quiet_kineto_without_cuda() -> None:
    """Without CUDA, Kineto logs each CUDA call it cannot make as an ERROR line: its log level is
    read at its first start, so set it before that (a user's own KINETO_LOG_LEVEL wins)."""
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("KINETO_LOG_LEVEL", "5")


def prime_profiler() -> None:
    """Initialise Kineto on this thread with one empty recording. Call it on the thread that first
    imported torch (an actor's constructor) when a later recording may start on another thread (a
    threaded actor's request): Kineto registers torch as its client on the importing thread and,
    first started elsewhere, skips the client's init and prints an ERROR line to the log."""
    import torch

    _quiet_kineto_without_cuda()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], acc_events=True):
        pass


class TraceRecorder:
    """torch.profiler over this process between `start` and `stop`: CUDA kernels and copies when
    CUDA is available, CPU ops unless `cpu_ops` is off (always without CUDA); the trainer's ranks
    and in-process engines use it."""

    def __init__(self, with_stack: bool = False, cpu_ops: bool = True):
        self.with_stack, self.cpu_ops = with_stack, cpu_ops
        self.folder = tempfile.mkdtemp(prefix="rlcore-profile-")
        self._prof = None
        self._label = ""

    def start(self, label: str) -> None:
        """Begin recording; `label` names the trace file (e.g. `step3`)."""
        import torch

        if self._prof is not None:  # a stop that never came (its caller timed out): drop that trace
            self._prof.stop()
        activities = []
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        if self.cpu_ops or not activities:  # a process without CUDA has nothing else to record
            activities.append(torch.profiler.ProfilerActivity.CPU)
        _quiet_kineto_without_cuda()
        kwargs: dict[str, Any] = {}
        try:  # every thread's ops: an actor's requests run on threads other than the one that starts this
            from torch._C._profiler import _ExperimentalConfig

            kwargs["experimental_config"] = _ExperimentalConfig(profile_all_threads=True)
        except (ImportError, TypeError):  # an older torch: the starting thread's ops (GPU kernels: all)
            pass
        # acc_events: one recording per profile object anyway; without it torch warns, each start, that
        # events of earlier cycles are dropped
        self._prof = torch.profiler.profile(
            activities=activities, with_stack=self.with_stack, acc_events=True, **kwargs
        )
        self._label = label
        self._prof.start()

    def stop(self) -> list[tuple[str, bytes]]:
        """End recording; the trace as [(file name, gzipped Chrome trace bytes)] (empty when
        `start` was not called)."""
        if self._prof is None:
            return []
        prof, self._prof = self._prof, None
        prof.stop()
        path = Path(self.folder) / f"{self._label}.json.gz"
        prof.export_chrome_trace(str(path))  # gzipped by its suffix
        data = path.read_bytes()
        path.unlink()
        return [(path.name, data)]


def config_problems(cfg) -> list[tuple[str, str]]:
    """profile.*: steps an RL run reaches, each once."""
    p = cfg.profile
    out = []
    steps = list(p.steps)
    if steps and cfg.mode != "rl":
        out.append(("profile.steps", f"records RL steps; mode={cfg.mode} has none (leave it empty)"))
        return out
    bad = [s for s in steps if isinstance(s, bool) or not isinstance(s, int) or not 1 <= s <= cfg.steps]
    if bad:
        out.append(
            ("profile.steps", f"{bad[0]!r} is not a step of this run: give steps in 1..{cfg.steps} (steps={cfg.steps})")
        )
    elif len(set(steps)) != len(steps):
        out.append(("profile.steps", f"lists a step twice: {steps}"))
    return out
