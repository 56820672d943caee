"""What the RL driver does around its event loop: resume, checkpoints, evaluation, export.

`StepHooks` gets the run state (`actors.run_state.RunState`) and the components it needs, and is
called by `actors.driver.Driver` at fixed points:

- `setup()` (end of `Driver.setup`): a fresh start runs the SFT warm-up if configured
  (while the engines start, `Starts.poll` between steps), waits for them (`Starts.wait`) and syncs
  its version (0 without one) to the engines; a resume loads the trainer checkpoint (any world
  size), restores the run state, trims metrics rows logged after the checkpoint, and syncs the
  checkpoint's weights;
- `after_step()` (after each step is logged): data-order row, checkpoint, evaluation launch, and
  after the last step the export;
- `refs()` / `owns()` / `on_ready()` (inside the loop): evaluation requests; `holds_sync()`: whether
  the next weight sync waits for one (synchronous runs);
- `finish()` (after the loop): waits for evaluations still running.

Resume semantics. The checkpoint of step s holds the stream position and the tasks still
generating, buffered or at the teacher at that moment (put back in stream order and generated
again on resume; their samples leave the accounting as if never requested). In a synchronous run
(`algo.max_off_policy_steps=0`) nothing is in flight at a step boundary, so a resumed run sees
exactly the data, seeds and weights of an uninterrupted one.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable

from actors.evaluation import Evaluator
from actors.resume import resume_from
from actors.rollout_group import RolloutGroup
from actors.run_state import RunState
from actors.sft import warmup
from actors.starts import Starts
from actors.teacher import TeacherStage
from actors.trainer_group import TrainerGroup
from actors.weights import WeightSync
from rlcore.batch.buffer import RolloutBuffer
from rlcore.config import RunConfig
from rlcore.report.events import EVENTS_FILE
from rlcore.report.startup import StartupPhases
from rlcore.storage import checkpoint as ckpt
from rlcore.storage.rundir import SERIES_FILES
from rlcore.storage.series import append_rows, fsync_series

log = logging.getLogger("rlcore")

DATA_ORDER = "data_order.jsonl"


def append_jsonl(path: Path, row: dict[str, Any]) -> None:
    """One row appended whole (rlcore.storage.series); StorageError when it cannot be written."""
    append_rows(path, [row], sort_keys=False)


class StepHooks:
    """`starts`: what is still starting beside the trainer (engines, teacher); `teacher`: the
    teacher stage, whose waiting groups a checkpoint puts back like generating ones (None
    without a teacher)."""

    def __init__(
        self,
        cfg: RunConfig,
        run: RunState,
        env,
        trainers: TrainerGroup,
        rollouts: RolloutGroup,
        weights: WeightSync,
        buffer: RolloutBuffer,
        startup: StartupPhases,
        starts: Starts,
        teacher: TeacherStage | None,
    ):
        self.cfg, self.run, self.env = cfg, run, env
        self.trainers, self.rollouts, self.weights, self.buffer = trainers, rollouts, weights, buffer
        self.startup, self.starts, self.teacher = startup, starts, teacher
        self.out = Path(cfg.output_dir)
        self.writer = ckpt.CheckpointWriter(cfg)
        self.evaluator = None
        self.last_checkpoint: Path | None = None
        self.start_step = 0  # the step the run started from (a resume's checkpoint step)
        self.resumed_restarts: dict[str, int] = {}  # the restart counters of the checkpoint loaded last
        self._sync_held_since: float | None = None  # when `holds_sync` began holding the sync
        self._sync_hold_said = False

    def newest_checkpoint(self) -> Path | None:
        """The checkpoint a restart or a resume goes back to: the newest this run saved or
        resumed from, else the newest complete one in its folder."""
        return self.last_checkpoint or ckpt.latest_checkpoint(self.writer.root)

    def drop_evaluations(self) -> None:
        """Forget the evaluation requests in flight (a restart goes back before them)."""
        if self.evaluator is not None:
            self.evaluator.drop()

    # -- setup / resume ------------------------------------------------------------------------
    def setup(self) -> None:
        """A fresh start or a resume, up to the first weight sync: `starts.poll()` (never blocks,
        raises if something failed to start) between SFT warm-up steps, which run while the
        engines start; `starts.wait()` before the first sync."""
        cfg, run, phase = self.cfg, self.run, self.startup.phase
        if cfg.eval.every_n_steps > 0:
            self.evaluator = Evaluator(
                cfg.eval, cfg.rollout, self.env, self.rollouts.handles, lambda: self.rollouts.episode_serving
            )
        self.writer.clean_stale()
        path = ckpt.resolve_resume(cfg)
        if path is None:
            if ckpt.resume_request(cfg) == "latest":
                log.info("resume: no checkpoint in %s yet; starting fresh", self.writer.root)
            version = 0
            if cfg.sft.warmup_steps > 0:  # a fresh run only: a resumed one has its weights
                log.info(
                    "SFT warm-up: %d steps on sft.dataset=%s before RL%s (sft.warmup_steps=0 skips it)",
                    cfg.sft.warmup_steps,
                    cfg.sft.dataset,
                    f", on the trained model.path={cfg.model.path}" if cfg.model.path else "",
                )
                with phase(f"SFT warm-up ({cfg.sft.warmup_steps} steps)", chatty=True):
                    version = warmup(cfg, self.trainers, self.starts.poll)
            self.starts.wait()
            with phase("first weight sync", chatty=True):
                self.weights.sync(version)  # engines start from exactly the trainer's weights
            if self.evaluator is not None and cfg.eval.at_start:
                self.evaluator.launch(0, version)
            return
        self.starts.wait()
        self.load_checkpoint(path)
        # a resume goes on counting the run's restarts (a trainer restart's load keeps this process's)
        run.restarts_before = dict(self.resumed_restarts)
        run.restarts_logged = dict(self.resumed_restarts)

    def load_checkpoint(self, path: Path, phase: Callable | None = None) -> int:
        """Load the RL checkpoint `path` into the running driver, as a resume does: the trainer's
        weights and optimizer, the run state (step, feed with its put-back tasks, accounting
        without what was in flight, request_seq, actor cursor, RNG), the JSONL series cut back to
        its step, its weights synced to the serving engines (their version rolls back to the
        checkpoint's) and their RNG. Returns the checkpoint's step. A trainer restart
        (`actors.recovery`) calls it too, on a freshly started trainer group, with its own
        `phase` timer (default: the start-up phases')."""
        cfg, run, phase = self.cfg, self.run, phase or self.startup.phase
        state, version = resume_from(
            path,
            "rl",
            cfg,
            self.trainers,
            SERIES_FILES,
            phase,
            lambda s: bool(s.get("eval_due")) and self.evaluator is not None,
        )
        step = int(state["step"])
        run.step = self.start_step = step
        run.feed.restore(state["feed"])
        for k, v in state["accounting"].items():
            setattr(run.acct, k, v)
        # what was in flight is generated again: leave it out, as if never requested
        run.acct.generated -= run.acct.in_flight
        run.acct.in_flight = 0
        run.request_seq = int(state["request_seq"])
        self.resumed_restarts = dict(state.get("restarts") or {})  # older checkpoints have none
        run.restore_cursor(cfg.rollout.num_actors)
        eval_due = bool(state.get("eval_due")) and self.evaluator is not None
        with phase("first weight sync"):
            self.weights.sync(version)
        self.rollouts.set_rng_states(state.get("engine_rng") or [])
        log.info(
            "resumed from %s: step %d, policy version %d, task stream at %d",
            path,
            step,
            run.version,
            run.feed.next_index,
        )
        if eval_due:  # its result was not logged before the stop: evaluate this policy again
            self.evaluator.launch(step, run.version)
        return step

    # -- between steps -------------------------------------------------------------------------
    def after_step(self, step: int, state, logger) -> None:
        """`step` optimizer steps are done and their weights are on the engines."""
        final = step >= self.cfg.steps
        append_jsonl(
            self.out / DATA_ORDER,
            {
                "step": step,
                "task_indices": [g.stream_index for g in state.batch],
                "task_ids": [g.task.id for g in state.batch],
            },
        )
        eval_due = self.evaluator is not None and self.evaluator.due(step, final)
        if self.writer.due(step, final):
            self.save(step, eval_due)
        if eval_due:
            self.evaluator.launch(step, self.run.version)
        if final and self.cfg.checkpoint.export_final:
            self.trainers.export()

    def interrupted(self, step: int, signal_name: str) -> Path | None:
        """The run stops early at the boundary after `step` steps (a signal asked for it): save
        that step unless it is saved already or saving is off; one line says which."""
        c = self.cfg.checkpoint
        if self.last_checkpoint is not None and self.last_checkpoint.name == ckpt.step_dir_name(step):
            path = self.last_checkpoint
        elif step == self.start_step:
            log.warning("%s: stopped before a step finished; nothing new to save", signal_name)
            return None
        elif c.interval <= 0 and not c.save_final:
            log.warning(
                "%s: stopped after step %d; no checkpoint kept (checkpoint.interval=0 and checkpoint.save_final=false)",
                signal_name,
                step,
            )
            return None
        else:
            path = self.save(step)
        log.warning(
            "%s: stopped after step %d of %d; checkpoint %s; continue with resume=true",
            signal_name,
            step,
            self.cfg.steps,
            path,
        )
        return path

    def capture(self, step: int, eval_due: bool) -> dict[str, Any]:
        run, buffer = self.run, self.buffer
        acct = asdict(run.acct)
        unfinished = []
        for g in buffer.snapshot():
            if buffer.is_stale(g, run.version):
                # the next batch drops it anyway (e.g. surplus of dynamic sampling): count it
                # dropped now instead of generating it again after a resume
                acct["in_flight"] -= len(g.samples)
                acct["dropped_stale"] += len(g.samples)
            else:
                unfinished.append((g.stream_index, g.task))
        unfinished += self.rollouts.unfinished()
        if self.teacher is not None:
            unfinished += [(g.stream_index, g.task) for g in self.teacher.groups()]
        return {
            "kind": "rl",
            "step": step,
            "version": run.version,
            "feed": run.feed.state(unfinished),
            "request_seq": run.request_seq,
            "accounting": acct,
            "restarts": dict(run.restarts_logged),
            "rng": ckpt.rng_state(),
            "engine_rng": self.rollouts.rng_states(self.cfg.checkpoint.timeout_s),
            "eval_due": eval_due,
        }

    def save(self, step: int, eval_due: bool = False) -> Path:
        # the series as far as this checkpoint are on disk before it commits (a crash after the
        # commit never loses rows the checkpoint counts)
        fsync_series(self.out, SERIES_FILES + (EVENTS_FILE,))
        self.last_checkpoint = self.trainers.save(self.writer, step, lambda: self.capture(step, eval_due))
        return self.last_checkpoint

    # -- evaluation inside the loop ------------------------------------------------------------
    def refs(self) -> list:
        return self.evaluator.refs() if self.evaluator is not None else []

    def holds_sync(self) -> bool:
        """Asked before each weight sync of a synchronous run (`algo.max_off_policy_steps=0`, the
        driver's call): whether the sync waits, because an evaluation request still runs on the
        policy it would replace; at most `eval.timeout_s` per evaluation, then one line and the
        sync goes on. Asynchronous runs never ask (their rounds report the versions that decoded
        them, `eval/version_min/max`)."""
        # Why: the engines swap weights between two decode steps, so a sync landing while an
        # evaluation decodes gives its later tokens to the next policy, at a point set by timing
        # (how fast rewards score, e.g. a resumed run's reward workers starting cold): the
        # round's result then differs between a run and its resume (issue 54's note).
        ev = self.evaluator
        if ev is None or not ev.running():
            # (chunks queued with no request running wait for an engine to join: no hold)
            self._sync_held_since, self._sync_hold_said = None, False
            return False
        now = time.monotonic()
        if self._sync_held_since is None:
            self._sync_held_since = now
        if now - self._sync_held_since < self.cfg.eval.timeout_s:
            return True
        if not self._sync_hold_said:
            self._sync_hold_said = True
            log.warning(
                "evaluation of step(s) %s still runs after eval.timeout_s=%.0fs: the weight sync goes on; "
                "its later tokens come from the next policy (eval/version_max)",
                [r.step for r in ev.rounds],
                self.cfg.eval.timeout_s,
            )
        return False

    def engines_joined(self) -> None:
        """Engines joined the weight group again: evaluation chunks waiting for one can go."""
        if self.evaluator is not None:
            self.evaluator.pump()

    def owns(self, ref) -> bool:
        return self.evaluator is not None and self.evaluator.owns(ref)

    def on_ready(self, ref, logger) -> None:
        rec = self.evaluator.collect(ref)
        if rec is not None:
            logger.log_eval(rec)

    def finish(self, logger) -> None:
        if self.evaluator is not None and self.evaluator.busy:
            self.evaluator.drain(logger.log_eval, self.cfg.eval.timeout_s)
