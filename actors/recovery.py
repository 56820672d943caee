"""A run that heals itself: a trainer rank that dies (in a train step, a weight sync, its canary
or a checkpoint save) costs the run at most the steps since its last checkpoint, not the run,
and with nothing configured not even those.

`TrainerRecovery.recover` is called from one place in the driver loop with the `ActorDied` that
stopped it. Within `trainer.max_restarts` it kills the ranks left and starts new ones in the
same placement-group bundles (`TrainerGroup.restart`: a dead node's bundles are rescheduled on
the resources left), re-forms the weight group, and gives the new ranks weights from one of two
places (`trainer.heal_from`):

- the engines: each serving engine holds the last synced version, whole (a sync lands
  atomically). The new ranks read one engine's weights from the object store and take them as
  that version; the learning-rate schedule goes on from there, the optimizer's moments start
  again (one line says so). The run state stays as it is: what is generating or buffered goes on,
  and a batch whose train step died is put back and trained again. No step is lost.
- the last checkpoint, exactly as a resume loads it (`StepHooks.load_checkpoint`: run state,
  series cut back, its weights synced to the engines, which roll back to its version). What
  was generating, buffered, at the teacher or being evaluated is newer than the checkpoint: it
  is dropped and its tasks put back. The steps since the checkpoint are trained again.

`auto` (the default) takes the last checkpoint when one exists (it keeps the optimizer's
moments: measured, they are worth more than the steps since it), else the engines. Otherwise the error goes on,
saying first why the trainer was not restarted.
"""

from __future__ import annotations

import contextlib
import logging
import time

from actors.lifecycle import StepHooks
from actors.remote import ActorDied, RunError
from actors.rollout_group import RolloutGroup
from actors.run_state import RunState
from actors.teacher import TeacherStage
from actors.trainer_group import TrainerGroup
from actors.weights import WeightSync
from rlcore.batch.buffer import RolloutBuffer
from rlcore.config import TrainerConfig
from rlcore.report.console import one_line
from rlcore.report.failures import FailureLog
from rlcore.types import GroupMeta

log = logging.getLogger("rlcore")

CAUSE_CHARS = 300
"""How much of the death's own message a stopping error quotes (the whole one is in the log)."""


def dead_trainer_ranks(exc: BaseException) -> list[str]:
    """The trainer ranks an `ActorDied` names ("trainer rank i"); [] for any other error."""
    return [d for d in exc.dead if d.startswith("trainer rank")] if isinstance(exc, ActorDied) else []


def cause(exc: BaseException) -> str:
    """The death's message on one line, cut to `CAUSE_CHARS`."""
    text = one_line(str(exc))
    return text if len(text) <= CAUSE_CHARS else text[:CAUSE_CHARS] + " ..."


@contextlib.contextmanager
def _untimed(label: str):
    yield  # a recovery's phases are not start-up phases: the restart's own log line times it


class TrainerRecovery:
    """Restarts of the trainer group after a rank died; `restarts` counts them (`trainer_restarts`).
    `rewound`: whether the latest restart went back to a checkpoint (the driver's series and
    counters were cut back with it)."""

    def __init__(
        self,
        trainer: TrainerConfig,
        trainers: TrainerGroup,
        rollouts: RolloutGroup,
        weights: WeightSync,
        hooks: StepHooks,
        run: RunState,
        buffer: RolloutBuffer,
        teacher: TeacherStage | None,
        failures: FailureLog,
    ):
        self.settings, self.trainers, self.rollouts, self.weights = trainer, trainers, rollouts, weights
        self.hooks, self.run, self.buffer, self.teacher, self.failures = hooks, run, buffer, teacher, failures
        self.restarts = 0
        self.rewound = False
        self.last: tuple[int, float] | None = None  # (step continued from, seconds) of the latest restart
        self.source: str | None = None  # "engines" or "checkpoint": where the latest restart took its weights

    def checkpoint(self):
        """The checkpoint a restart goes back to: the newest this run saved or resumed from."""
        return self.hooks.newest_checkpoint()

    def stop(self, exc: RunError, why: str) -> RunError:
        """The error that ends the run: why the trainer was not restarted first, then the death."""
        err = RunError(
            f"{', '.join(dead_trainer_ranks(exc))} died and the trainer group was not restarted: "
            f"{why}. The death: {cause(exc)}"
        )
        err.__cause__ = exc
        return err

    def recover(self, exc: RunError, logger, unfinished: list[GroupMeta] | None = None) -> int:
        """Heal the run after `exc`, or raise: returns the step the loop continues from.
        `unfinished`: the batch whose train step the death interrupted (None: none), put back
        when the restart keeps the run state. Raises `exc` itself for anything but a trainer rank's
        death and when `trainer.max_restarts` is 0, and a RunError saying why when the restarts
        are used up or no source of weights exists."""
        dead = dead_trainer_ranks(exc)
        limit = self.settings.max_restarts
        if not dead or limit == 0:
            raise exc
        if self.restarts >= limit:
            raise self.stop(exc, f"trainer.max_restarts={limit} restart(s) used")
        run = self.run
        start, at_step, at_version = time.perf_counter(), run.step, run.version
        path, mode = self.checkpoint(), self.settings.heal_from
        if mode == "checkpoint" and path is None:
            raise self.stop(
                exc,
                "no checkpoint exists to restart it from (trainer.heal_from=checkpoint; set "
                "checkpoint.interval, or trainer.heal_from=auto to take the engines' weights)",
            )
        # auto: the optimizer's moments (a checkpoint's) are worth more than the steps since it
        # (benchmarks/trainer_heal.py: from the engines, the reward of the steps after the restart
        # fell to 0.29, from a checkpoint 2 steps older it stayed at 0.41)
        engine = (
            None if mode == "checkpoint" or (mode == "auto" and path is not None) else self.rollouts.holding(at_version)
        )
        if engine is None and (mode == "engines" or path is None):
            raise self.stop(
                exc,
                f"no serving engine holds the last synced version {at_version}"
                f"{' and no checkpoint exists (set checkpoint.interval)' if path is None else ''}",
            )
        before = self.trainers.placed or self.trainers.nodes()  # where they ran, not where Ray put them since
        self.restarts += 1
        self.trainers.restart(at_step)  # it waits for Ray to re-place the bundles of a dead node
        where = self.trainers.dead_nodes(before)  # so a dead node is known dead by now
        died = (
            f"{', '.join(dead)} died ({str(exc).split(' failed:')[0]}"
            f"{'; node ' + ', '.join(where) + ' is dead' if where else ''}) at step {at_step}, "
            f"policy version {at_version}"
        )
        self.weights.drop_canary()  # the dead ranks owed its answer; the sync below runs a new one
        self.weights.form()
        if engine is not None:
            try:
                put_back = self.from_engines(engine, at_version, unfinished)
            except RunError as refused:
                if path is None or mode == "engines":
                    raise self.stop(exc, f"the engines' weights could not be loaded ({cause(refused)})") from refused
                log.warning(
                    "trainer restart: the engines' weights could not be loaded (%s); going back to the last checkpoint",
                    cause(refused),
                )
            else:
                self.rewound, self.source = False, "engines"
                self.last = (run.step, time.perf_counter() - start)
                log.warning(
                    "%s; restarted the trainer group from the weights of rollout actor %d (version %d) in "
                    "%.1fs, no step lost; the optimizer state was reset (AdamW moments start again)%s "
                    "(trainer restart %d of %d)",
                    died,
                    engine,
                    at_version,
                    self.last[1],
                    f"; the interrupted step's {put_back} samples are trained again" if put_back else "",
                    self.restarts,
                    limit,
                )
                return run.step
        step, dropped = self.from_checkpoint(path, logger)
        self.rewound, self.source = True, "checkpoint"
        self.last = (step, time.perf_counter() - start)
        log.warning(
            "%s; restarted the trainer group from checkpoint %s (step %d) in %.1fs; %d samples in flight "
            "or buffered dropped, their tasks put back (trainer restart %d of %d)",
            died,
            path,
            step,
            self.last[1],
            dropped,
            self.restarts,
            limit,
        )
        return step

    def from_engines(self, engine: int, version: int, unfinished: list[GroupMeta] | None) -> int:
        """The new ranks take engine `engine`'s weights as `version`; the sync that follows checks
        them against every engine (the canary). Returns the samples put back."""
        self.trainers.load_engine_weights(self.rollouts.weights(engine), version)
        self.weights.sync(version)
        if not unfinished:
            return 0
        self.buffer.put_back(unfinished)
        return sum(len(g.samples) for g in unfinished)

    def from_checkpoint(self, path, logger) -> tuple[int, int]:
        """Load checkpoint `path` as a resume does: (its step, samples dropped from flight)."""
        dropped = self.drop_in_flight()
        step = self.hooks.load_checkpoint(path, phase=_untimed)
        # failures counted since the last logged row (engines on a dead node, rewards) belong to
        # steps the checkpoint's accounting goes back before: the next row must not count them
        self.failures.discard()
        logger.reopen()  # the cut-back metrics.jsonl is a new file
        return step, dropped

    def drop_in_flight(self) -> int:
        """Forget what is newer than any checkpoint: requests in flight, buffered groups, groups at
        the teacher, evaluations. Returns the generate samples dropped from flight."""
        dropped = self.rollouts.drop_pending()
        dropped += sum(len(g.samples) for g in self.buffer.snapshot())
        self.buffer.clear()
        if self.teacher is not None:
            dropped += self.teacher.waiting_samples()
            self.teacher.drop()
        self.hooks.drop_evaluations()
        return dropped
