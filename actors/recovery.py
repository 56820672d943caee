"""A run that heals itself: a trainer rank that dies (in a train step, a weight sync, its canary
or a checkpoint save) costs the run the steps since its last checkpoint, not the run.

`TrainerRecovery.recover` is called from one place in the driver loop with the `ActorDied` that
stopped it. Within `trainer.max_restarts`, and with a checkpoint to go back to, it drops what is
generating, buffered, at the teacher or being evaluated (all of it is newer than the checkpoint,
whose accounting leaves its own in-flight work out and puts those tasks back), restarts the
trainer group in its placement-group bundles (`TrainerGroup.restart`: a dead node's bundles are
rescheduled on the resources left), re-forms the weight group and loads the checkpoint exactly
as a resume does (`StepHooks.load_checkpoint`: run state, series cut back, its weights synced to
the engines, which roll back to its version), and forgets the failure reasons counted since the
last logged row (the checkpoint's accounting has none of them). Otherwise the error goes on, saying why the
trainer was not restarted.
"""

from __future__ import annotations

import contextlib
import logging
import time

from actors.lifecycle import StepHooks
from actors.remote import ActorDied, RunError
from actors.rollout_group import RolloutGroup
from actors.teacher import TeacherStage
from actors.trainer_group import TrainerGroup
from actors.weights import WeightSync
from rlcore.buffer import RolloutBuffer
from rlcore.checkpoint import latest_checkpoint
from rlcore.config import RunConfig
from rlcore.report.failures import FailureLog

log = logging.getLogger("rlcore")


def dead_trainer_ranks(exc: BaseException) -> list[str]:
    """The trainer ranks an `ActorDied` names ("trainer rank i"); [] for any other error."""
    return [d for d in exc.dead if d.startswith("trainer rank")] if isinstance(exc, ActorDied) else []


@contextlib.contextmanager
def _untimed(label: str):
    yield  # a recovery's phases are not start-up phases: the restart's own log line times it


class TrainerRecovery:
    """Restarts of the trainer group after a rank died; `restarts` counts them (`trainer_restarts`)."""

    def __init__(self, cfg: RunConfig, trainers: TrainerGroup, rollouts: RolloutGroup, weights: WeightSync,
                 hooks: StepHooks, buffer: RolloutBuffer, teacher: TeacherStage | None, failures: FailureLog):
        self.cfg, self.trainers, self.rollouts, self.weights = cfg, trainers, rollouts, weights
        self.hooks, self.buffer, self.teacher, self.failures = hooks, buffer, teacher, failures
        self.restarts = 0
        self.last: tuple[int, float] | None = None  # (checkpoint step, seconds) of the latest restart

    def checkpoint(self):
        """The checkpoint a restart goes back to: the newest this run saved or resumed from."""
        return self.hooks.last_checkpoint or latest_checkpoint(self.hooks.writer.root)

    def recover(self, exc: RunError, logger) -> int:
        """Heal the run after `exc`, or raise it: returns the checkpoint's step, where the loop
        continues. Raises `exc` itself for anything but a trainer rank's death and when
        `trainer.max_restarts` is 0, and a RunError saying why when the restarts are used up or no
        checkpoint exists."""
        dead = dead_trainer_ranks(exc)
        limit = self.cfg.trainer.max_restarts
        if not dead or limit == 0:
            raise exc
        if self.restarts >= limit:
            raise RunError(f"{exc}; the trainer group was not restarted again: trainer.max_restarts={limit} "
                           f"restart(s) used") from exc
        path = self.checkpoint()
        if path is None:
            raise RunError(f"{exc}; the trainer group was not restarted: no checkpoint existed to restart "
                           f"it from (set checkpoint.interval)") from exc
        start, at_step, at_version = time.perf_counter(), self.hooks.run.step, self.hooks.run.version
        self.restarts += 1
        dropped = self.drop_in_flight()
        self.trainers.restart()
        self.weights.form()
        step = self.hooks.load_checkpoint(path, phase=_untimed)
        # failures counted since the last logged row (engines on a dead node, rewards) belong to
        # steps the checkpoint's accounting goes back before: the next row must not count them
        self.failures.discard()
        logger.reopen()  # the cut-back metrics.jsonl is a new file
        self.last = (step, time.perf_counter() - start)
        log.warning("%s died (%s) at step %d, policy version %d; restarted the trainer group from checkpoint %s "
                    "(step %d) in %.1fs; %d samples in flight or buffered dropped, their tasks put back "
                    "(trainer restart %d of %d)", ", ".join(dead), str(exc).split(" failed:")[0], at_step,
                    at_version, path, step, self.last[1], dropped, self.restarts, limit)
        return step

    def drop_in_flight(self) -> int:
        """Forget what is newer than any checkpoint: requests in flight, buffered groups, groups at
        the teacher, evaluations. Returns the generate samples dropped from flight."""
        dropped = self.rollouts.drop_pending()
        dropped += sum(len(g.samples) for g in self.buffer.snapshot())
        self.buffer.clear()
        if self.teacher is not None:
            dropped += self.teacher.waiting_samples()
            self.teacher.drop()
        if self.hooks.evaluator is not None:
            self.hooks.evaluator.drop()
        return dropped
