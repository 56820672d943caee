"""The driver's side of `profile.steps`: around each recorded step, every trainer rank and every
serving engine starts its profiler, and afterwards hands its trace back through Ray; the traces
land in `{output_dir}/profile/SOURCE/` with the step's wall-clock window in `windows.jsonl`
(read by `rlcore.report.timeline`).

A profiler that fails to start or stop costs its trace, never the run: the step goes on, a
warning names the process, and the summary says how many processes a step recorded.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import ray

from actors.remote import forget
from rlcore.config import ProfileConfig
from rlcore.report.timeline import SOURCE_FILE, WINDOWS_FILE, build
from rlcore.storage.series import append_rows

log = logging.getLogger("rlcore")  # as every driver component: its warnings reach events.jsonl


def _wall_us() -> float:
    return time.time_ns() / 1000.0


class RunProfiler:
    """Records the steps of `profile.steps` (`begin` before the step's batch goes to the
    trainer, `end` once its weights reached the engines) into `output_dir`/profile."""

    def __init__(self, profile: ProfileConfig, output_dir: str, trainers, rollouts):
        self.steps = set(profile.steps)
        self.folder = Path(output_dir) / "profile"
        self.timeout_s = profile.timeout_s
        self.trainers, self.rollouts = trainers, rollouts
        self.recorded = 0
        self._open: tuple[int, float, list[tuple[str, Any]]] | None = None  # step, start, (folder, actor)

    def begin(self, step: int) -> None:
        """Start every process's profiler when `step` is one to record."""
        if step not in self.steps:
            return
        if self._open is not None:  # the last one never ended (its step ran again after a fault)
            self._stop(keep=False)
        actors = [(f"trainer{i}", h) for i, h in enumerate(self.trainers.handles)]
        actors += [(f"engine{i}", self.rollouts.handles[i]) for i in self.rollouts.serving]
        infos = self._gather([(name, actor.start_profile.remote(f"step{step}")) for name, actor in actors], "start")
        started = [(name, actor) for name, actor in actors if name in infos]
        for name, info in infos.items():
            folder = self.folder / name
            folder.mkdir(parents=True, exist_ok=True)
            (folder / SOURCE_FILE).write_text(json.dumps(info))
        self._open = (step, _wall_us(), started)

    def end(self, step: int) -> None:
        """Stop the profilers of `step` and keep their traces and the step's window."""
        if self._open is not None and self._open[0] == step:
            self._stop(keep=True)

    def close(self) -> None:
        """The run ends: a recording still open (the run stopped inside its step) is dropped."""
        if self._open is not None:
            self._stop(keep=False)

    def report(self) -> list[str]:
        """The timeline summary of the recorded steps (empty when none was recorded)."""
        if not self.recorded:
            return []
        try:
            return build(self.folder)
        except (OSError, ValueError, KeyError) as exc:
            return [f"profile: the traces under {self.folder} could not be read ({type(exc).__name__}: {exc})"]

    def _stop(self, keep: bool) -> None:
        step, start_us, started = self._open
        self._open = None
        end_us = _wall_us()
        traces = self._gather([(name, actor.stop_profile.remote()) for name, actor in started], "stop")
        if not keep:
            return
        for name, files in traces.items():
            for file_name, data in files:
                base = Path(file_name).name
                base = base if base.startswith(f"step{step}") else f"step{step}-{base}"
                (self.folder / name / base).write_bytes(data)
        append_rows(
            self.folder / WINDOWS_FILE,
            [{"step": step, "start_us": start_us, "end_us": end_us, "processes": sorted(traces)}],
            sort_keys=False,
        )
        self.recorded += 1

    def _gather(self, calls: list[tuple[str, Any]], what: str) -> dict[str, Any]:
        """Each call's result by name, within `profile.timeout_s` in all; one warning per failure."""
        if not calls:
            return {}
        refs = [ref for _, ref in calls]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.timeout_s)
        ready_ids = {r.binary() for r in ready}
        out = {}
        for name, ref in calls:
            if ref.binary() not in ready_ids:
                forget([ref])  # read once it finishes: a late error is not printed as Ray's "unhandled error"
                log.warning(
                    "profile: %s did not %s its profiler within profile.timeout_s=%s s; its trace of "
                    "this step is missing",
                    name,
                    what,
                    self.timeout_s,
                )
                continue
            try:
                out[name] = ray.get(ref, timeout=1.0)
            except Exception as exc:  # noqa: BLE001 - a profiler's fault costs its trace, not the run
                log.warning(
                    "profile: %s could not %s its profiler (%s: %s); its trace of this step is missing",
                    name,
                    what,
                    type(exc).__name__,
                    str(exc).splitlines()[0] if str(exc) else "",
                )
        return out
