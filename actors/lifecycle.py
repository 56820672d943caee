"""What the RL driver does around its event loop: data order, resume, checkpoints, evaluation.

`TaskFeed` is the training data order: the environment's train stream, indexed, plus tasks a
resume put back; each generate request is seeded from its first task's index
(`rollout.request_seeds`), so what a request samples does not depend on which actor or thread
runs it, or on what runs next to it.

`StepHooks` is called by `actors.driver.Driver` at fixed points:

- `setup()` (end of `Driver.setup`): a fresh start syncs version 0 to the engines; a resume loads
  the trainer checkpoint (any world size), restores the driver state, trims metrics rows logged
  after the checkpoint, and syncs the checkpoint's weights;
- `after_step()` (after each step is logged): data-order row, checkpoint, evaluation launch, and
  after the last step the export;
- `refs()` / `owns()` / `on_ready()` (inside the loop): evaluation requests;
- `finish()` (after the loop): waits for evaluations still running.

Resume semantics. The checkpoint of step s holds the stream position and the tasks still
generating or buffered at that moment (put back in stream order and generated again on resume;
their samples leave the accounting as if never requested). In a synchronous run
(`algo.max_off_policy_steps=0`) nothing is in flight at a step boundary, so a resumed run sees
exactly the data, seeds and weights of an uninterrupted one.
"""

from __future__ import annotations

import json
import logging
import time
from collections import deque
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from actors.evaluation import Evaluator
from actors.remote import RunError, get
from actors.sft import warmup
from rlcore import checkpoint as ckpt
from rlcore.config_keys import config_dict
from rlcore.rundir import SERIES_FILES
from rlcore.seeding import derive_seed
from rlcore.types import Task

if TYPE_CHECKING:
    from actors.driver import Driver

log = logging.getLogger("rlcore")

DATA_ORDER = "data_order.jsonl"


class TaskFeed:
    """Indexed training tasks: put-back tasks first (in stream order), then the stream."""

    def __init__(self, env, cfg, start: int = 0):
        self.env, self.cfg = env, cfg
        self.restart(start)
        self.requeued: deque[tuple[int, Task]] = deque()

    def restart(self, start: int) -> None:
        self.next_index = start
        self._stream = self.env.tasks("train", start=start)

    def take(self, n: int) -> tuple[list[int], list[Task]]:
        indices, tasks = [], []
        for _ in range(n):
            if self.requeued:
                i, t = self.requeued.popleft()
            else:
                i, t = self.next_index, next(self._stream)
                self.next_index += 1
            indices.append(i)
            tasks.append(t)
        return indices, tasks

    def seed(self, indices: list[int]) -> int | None:
        """The seed of a request whose first task is `indices[0]` (None: the engine's own RNG)."""
        if not self.cfg.rollout.request_seeds or not indices:
            return None
        return derive_seed(self.cfg.seed, "train", indices[0])

    def state(self, unfinished: list[tuple[int, Task]]) -> dict[str, Any]:
        """`unfinished`: tasks taken but not yet trained; they are handed out again on resume."""
        back = sorted([*unfinished, *self.requeued], key=lambda it: it[0])
        return {"next_index": self.next_index, "requeue": back}

    def restore(self, state: dict[str, Any]) -> None:
        self.restart(int(state["next_index"]))
        self.requeued = deque(state["requeue"])


def append_jsonl(path: Path, row: dict[str, Any]) -> None:
    with path.open("a") as f:
        f.write(json.dumps(row) + "\n")


class StepHooks:
    def __init__(self, driver: "Driver"):
        self.d = driver
        self.cfg = driver.cfg
        self.out = Path(self.cfg.output_dir)
        self.writer = ckpt.CheckpointWriter(self.cfg)
        self.evaluator = None
        self.last_checkpoint: Path | None = None

    # -- setup / resume ------------------------------------------------------------------------
    def setup(self) -> None:
        d, cfg = self.d, self.cfg
        if cfg.eval.every_n_steps > 0:
            self.evaluator = Evaluator(cfg, d.env, d.groups.rollouts, lambda: d.members.serving)
        self.writer.clean_stale()
        path = ckpt.resolve_resume(cfg)
        if path is None:
            if ckpt.resume_request(cfg) == "latest":
                log.info("resume: no checkpoint in %s yet; starting fresh", self.writer.root)
            version = 0
            if cfg.sft.warmup_steps > 0:  # a fresh run only: a resumed one has its weights
                log.info("SFT warm-up: %d steps on sft.dataset=%s before RL%s (sft.warmup_steps=0 skips it)",
                         cfg.sft.warmup_steps, cfg.sft.dataset,
                         f", on the trained model.path={cfg.model.path}" if cfg.model.path else "")
                with d.startup.phase(f"SFT warm-up ({cfg.sft.warmup_steps} steps)", chatty=True):
                    version = warmup(cfg, d.groups.trainers)
            with d.startup.phase("first weight sync"):
                d.sync_weights(version)  # engines start from exactly the trainer's weights
            if self.evaluator is not None and cfg.eval.at_start:
                self.evaluator.launch(0, version)
            return
        state = ckpt.load_driver_state(path)
        if state.get("kind") != "rl":
            raise RunError(f"checkpoint.resume: {path} is a {state.get('kind')!r} checkpoint, not an RL one; to "
                           f"start RL from it, export it (python -m rlcore.export {path} OUT) and set model.path=OUT")
        self._warn_config_changes(path)
        with d.startup.phase("loading the checkpoint"):
            versions = get([tr.load_checkpoint.remote(str(path)) for tr in d.groups.trainers],
                           cfg.trainer.step_timeout_s, f"loading checkpoint {path}")
        step = int(state["step"])
        d.start_step = step
        d.feed.restore(state["feed"])
        for k, v in state["accounting"].items():
            setattr(d.acct, k, v)
        # what was in flight is generated again: leave it out, as if never requested
        d.acct.generated -= d.acct.in_flight
        d.acct.in_flight = 0
        d.request_seq = int(state["request_seq"])
        for _ in range(d.request_seq % max(1, cfg.rollout.num_actors)):
            next(d._next_actor)
        ckpt.set_rng_state(state["rng"])
        eval_due = bool(state.get("eval_due")) and self.evaluator is not None
        for name in SERIES_FILES:
            removed = ckpt.truncate_series(self.out / name, step, drop_eval_at_step=eval_due)
            if removed:
                log.info("resume: dropped %d rows of %s logged after step %d", removed, name, step)
        with d.startup.phase("first weight sync"):
            d.sync_weights(int(versions[0]))
        engine_rng = state.get("engine_rng") or []
        if len(engine_rng) == len(d.groups.rollouts):
            get([r.set_rng_state.remote(s) for r, s in zip(d.groups.rollouts, engine_rng)], 60, "engine RNG restore")
        log.info("resumed from %s: step %d, policy version %d, task stream at %d", path, step, d.version,
                 d.feed.next_index)
        if eval_due:  # its result was not logged before the stop: evaluate this policy again
            self.evaluator.launch(step, d.version)

    def _warn_config_changes(self, path: Path) -> None:
        try:
            changed = ckpt.config_differences(ckpt.read_meta(path).get("config") or {}, config_dict(self.cfg))
        except Exception:  # an unreadable meta is not a reason to refuse a resume
            return
        if changed:
            log.warning("resume: config differs from the checkpoint's in %s%s", ", ".join(changed[:8]),
                        " ..." if len(changed) > 8 else "")

    # -- between steps -------------------------------------------------------------------------
    def after_step(self, step: int, state, logger) -> None:
        """`step` optimizer steps are done and their weights are on the engines."""
        d = self.d
        final = step >= self.cfg.steps
        append_jsonl(self.out / DATA_ORDER, {"step": step, "task_indices": [g.stream_index for g in state.batch],
                                              "task_ids": [g.task.id for g in state.batch]})
        eval_due = self.evaluator is not None and self.evaluator.due(step, final)
        if self.writer.due(step, final):
            self.save(step, eval_due)
        if eval_due:
            self.evaluator.launch(step, d.version)
        if final and self.cfg.checkpoint.export_final:
            self.export()

    def interrupted(self, step: int, signal_name: str) -> Path | None:
        """The run stops early at the boundary after `step` steps (a signal asked for it): save
        that step unless it is saved already or saving is off; one line says which."""
        c = self.cfg.checkpoint
        saved = self.last_checkpoint is not None and self.last_checkpoint.name == ckpt.step_dir_name(step)
        if saved:
            path = self.last_checkpoint
        elif step == self.d.start_step:
            log.warning("%s: stopped before a step finished; nothing new to save", signal_name)
            return None
        elif c.interval <= 0 and not c.save_final:
            log.warning("%s: stopped after step %d; no checkpoint kept (checkpoint.interval=0 and "
                        "checkpoint.save_final=false)", signal_name, step)
            return None
        else:
            path = self.save(step)
        log.warning("%s: stopped after step %d of %d; checkpoint %s; continue with resume=true", signal_name, step,
                    self.cfg.steps, path)
        return path

    def capture(self, step: int, eval_due: bool) -> dict[str, Any]:
        d = self.d
        acct = asdict(d.acct)
        unfinished = []
        for g in d.buffer.snapshot():
            if d.buffer.is_stale(g, d.version):
                # the next batch drops it anyway (e.g. surplus of dynamic sampling): count it
                # dropped now instead of generating it again after a resume
                acct["in_flight"] -= len(g.samples)
                acct["dropped_stale"] += len(g.samples)
            else:
                unfinished.append((g.stream_index, g.task))
        unfinished += [(i, t) for req in d.pending.values() for i, t in zip(req.indices, req.tasks)]
        unfinished += [(g.stream_index, g.task) for g in d.teacher_groups()]
        # a restarting engine has no state worth keeping (None: it keeps its own seed on resume)
        serving = d.members.serving
        states = get([d.groups.rollouts[i].rng_state.remote() for i in serving], 60, "engine RNG state")
        engine_rng = [states[serving.index(i)] if i in serving else None for i in range(len(d.groups.rollouts))]
        return {"kind": "rl", "step": step, "version": d.version, "feed": d.feed.state(unfinished),
                "request_seq": d.request_seq, "accounting": acct, "rng": ckpt.rng_state(),
                "engine_rng": engine_rng, "eval_due": eval_due}

    def save(self, step: int, eval_due: bool = False) -> Path:
        start = time.perf_counter()
        tmp = self.writer.begin(step)
        try:
            get([tr.save_checkpoint.remote(str(tmp)) for tr in self.d.groups.trainers],
                self.cfg.trainer.step_timeout_s, f"checkpoint save of step {step}")
            path = self.writer.commit(tmp, step, self.capture(step, eval_due))
        except BaseException as exc:
            self.writer.abort(tmp)
            if isinstance(exc, RunError):
                raise
            if isinstance(exc, Exception):
                raise RunError(f"checkpoint save of step {step} to {self.writer.root} failed: {exc}") from exc
            raise
        self.last_checkpoint = path
        log.info("checkpoint %s saved in %.1fs", path, time.perf_counter() - start)
        return path

    def export(self) -> str:
        out = self.cfg.checkpoint.export_dir or str(self.out / "hf")
        get([tr.export_hf.remote(out) for tr in self.d.groups.trainers], self.cfg.trainer.step_timeout_s,
            f"export to {out}")
        log.info("exported the final weights to %s", out)
        return out

    # -- evaluation inside the loop ------------------------------------------------------------
    def refs(self) -> list:
        return self.evaluator.refs() if self.evaluator is not None else []

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
