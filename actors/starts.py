"""What starts beside the trainer: the rollout engines (through `WeightSync`, which knows the
placement) and the teacher of on-policy distillation, each in the background where the devices
allow it, and the two questions the start-up asks of them: is anything still starting broken
(`poll`, between SFT warm-up steps), and wait for all of it (`wait`, before the first sync).

One component owns the order, so neither the driver nor the step hooks decide it or call back
into each other: the driver builds a `Starts`, begins it, and hands it to `StepHooks`.
"""

from __future__ import annotations

import time

from actors.remote import RunError
from actors.teacher import TeacherError, TeacherStage
from actors.weights import WeightSync
from rlcore.plan.layout import Plan
from rlcore.report.startup import StartupPhases


class Starts:
    """`teacher`: the teacher stage once `begin` placed it (None without a teacher: the plan has
    no teacher group)."""

    def __init__(self, plan: Plan, weights: WeightSync, startup: StartupPhases):
        self.plan, self.weights, self.startup = plan, weights, startup
        self.teacher: TeacherStage | None = None
        self._teacher_phase = None  # the teacher's start, when it runs in the background

    def begin(self) -> None:
        """Start the engines and the trainer (`WeightSync.start`), and the teacher: meanwhile
        where it has devices of its own, else after the engines and the trainer, whose memory it
        sizes itself around on a shared GPU."""
        wanted = bool(self.plan.teacher)
        meanwhile = wanted and self.weights.teacher_starts_meanwhile()
        if meanwhile:
            self.teacher = TeacherStage(self.plan)
            self._call(self.teacher.launch)
            self._teacher_phase = self.startup.background("starting the teacher")
        self.weights.start(self.startup)
        if wanted and not meanwhile:
            with self.startup.phase("starting the teacher"):
                self.teacher = TeacherStage(self.plan)
                self._call(self.teacher.start)

    def poll(self) -> None:
        """Never blocks: notes the engines and teacher that came up; one that failed to start
        stops the run here (RunError) instead of at the first sync."""
        self.weights.poll()
        if self._still_starting():
            if self._call(self.teacher.poll, failed=True):
                self._teacher_phase.finish()

    def wait(self) -> None:
        """Wait for everything still starting (engines, teacher) and form the weight group."""
        self.poll()
        if self._still_starting():
            waited = time.perf_counter()
            self._call(self.teacher.wait, failed=True)
            self._teacher_phase.finish(time.perf_counter() - waited)
        self.weights.join(self.startup)

    def _still_starting(self) -> bool:
        return self._teacher_phase is not None and self._teacher_phase.seconds is None

    def _call(self, fn, failed: bool = False):
        """`fn()`; a TeacherError is the run's RunError (and the background phase failed)."""
        try:
            return fn()
        except TeacherError as exc:
            if failed:
                self._teacher_phase.failed()
            raise RunError(str(exc)) from exc
