"""Evaluation rounds on the rollout group (`Evaluator`, during RL) and `mode=eval` (`EvalDriver`);
the metrics they compute are in `rlcore.report.evaluation`, whose docstring gives the rules."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import ray

from actors.groups import place
from actors.remote import RunError, get
from actors.rollout import failed_groups
from rlcore.batch.meta import group_meta
from rlcore.batch.seeding import derive_seed
from rlcore.config import EvalConfig, RolloutConfig
from rlcore.envs import build_env
from rlcore.plan.layout import Plan
from rlcore.report.evaluation import eval_tasks, sampling_overrides, summarize
from rlcore.report.startup import StartupPhases
from rlcore.storage import checkpoint as ckpt
from rlcore.types import GroupMeta, Task

log = logging.getLogger("rlcore")


@dataclass
class Round:
    """One evaluation in progress."""

    step: int
    version: int
    started: float
    queued: list[list[tuple[int, Task]]]
    results: dict[int, list[GroupMeta]] = field(default_factory=dict)
    """Finished requests by chunk number (kept in task order for the summary); metadata only:
    the token data of an evaluation never leaves the rollout actor."""
    outstanding: int = 0


class Evaluator:
    """Evaluation rounds on the rollout actors, interleaved with whatever else they run."""

    def __init__(
        self,
        settings: EvalConfig,
        rollout: RolloutConfig,
        env,
        rollouts: list,
        serving: Callable[[], list[int]] | None = None,
    ):
        """`settings`: the `eval` section; `rollout`: its tasks per request and the sampling eval
        overrides. `serving`: the actors that hold the current weights now (default: all; a
        restarted one is left out until it has joined again)."""
        self.settings, self.env, self.rollouts = settings, env, rollouts
        self.serving = serving or (lambda: list(range(len(rollouts))))
        self.tasks = eval_tasks(env, settings)
        per = rollout.tasks_per_request
        self.chunks = [self.tasks[i : i + per] for i in range(0, len(self.tasks), per)]
        self.sampling = sampling_overrides(settings, rollout.sampling)
        self.rounds: list[Round] = []
        self._inflight: dict[Any, tuple[Round, int, int]] = {}  # ref -> (round, chunk, actor)

    def due(self, step: int, final: bool) -> bool:
        n = self.settings.every_n_steps
        return n > 0 and (step % n == 0 or final)

    def launch(self, step: int, version: int) -> None:
        """Start a round for the policy of `step` (queued behind a round still running)."""
        self.rounds.append(Round(step, version, time.perf_counter(), list(enumerate(self.chunks))))
        self.pump()

    def pump(self) -> None:
        """Submit queued chunks, oldest round first, keeping one eval request per actor."""
        busy = {actor for _, _, actor in self._inflight.values()}
        free = [i for i in self.serving() if i not in busy]
        e = self.settings
        for rnd in self.rounds:
            while rnd.queued and free:
                chunk_no, chunk = rnd.queued.pop(0)
                actor = free.pop(0)
                first = chunk[0][0]
                ref = self.rollouts[actor].generate_meta.remote(
                    [t for _, t in chunk],
                    e.samples_per_task,
                    e.split,
                    derive_seed(e.seed, e.split, first),
                    self.sampling,
                )
                self._inflight[ref] = (rnd, chunk_no, actor)
                rnd.outstanding += 1

    def drop(self) -> None:
        """Forget every round (a trainer restart goes back to a checkpoint, which re-runs an
        evaluation it had due); requests still running finish unread."""
        self.rounds.clear()
        self._inflight.clear()

    def refs(self) -> list:
        return list(self._inflight)

    def running(self) -> bool:
        """Whether a request runs on an actor that serves now (one taken out as stalled, whose
        request may never answer, is not counted)."""
        serving = set(self.serving())
        return any(actor in serving for _, _, actor in self._inflight.values())

    def owns(self, ref) -> bool:
        return ref in self._inflight

    @property
    def busy(self) -> bool:
        return bool(self.rounds)

    def collect(self, ref) -> dict[str, Any] | None:
        """Take a finished eval request; returns the round's record when the round is complete."""
        rnd, chunk_no, actor = self._inflight.pop(ref)
        rnd.outstanding -= 1
        tasks = [t for _, t in self.chunks[chunk_no]]
        try:
            metas, _ = ray.get(ref, timeout=0)
            rnd.results[chunk_no] = [GroupMeta(task=t, samples=m) for t, m in zip(tasks, metas)]
        except ray.exceptions.RayError as exc:
            log.warning(
                "eval request on rollout actor %d failed (%s); its tasks count as failed", actor, type(exc).__name__
            )
            rnd.results[chunk_no] = [
                group_meta(g) for g in failed_groups(tasks, self.settings.samples_per_task, str(exc))
            ]
        self.pump()
        if rnd.queued or rnd.outstanding:
            return None
        self.rounds.remove(rnd)
        self.pump()
        return self.record(rnd)

    def record(self, rnd: Round) -> dict[str, Any]:
        groups = [g for i in sorted(rnd.results) for g in rnd.results[i]]
        e = self.settings
        rec: dict[str, Any] = {
            "step": rnd.step,
            "eval/policy_version": rnd.version,
            "eval/time_s": time.perf_counter() - rnd.started,
        }
        rec.update(summarize(groups, list(e.k), e.correct_threshold))
        # per environment (one environment per run today; the keys stay right when there are more)
        rec.update(summarize(groups, list(e.k), e.correct_threshold, prefix=f"eval/{self.env.name}/"))
        return rec

    def drain(self, on_record: Callable[[dict[str, Any]], None], timeout_s: float) -> None:
        """Wait (at most `timeout_s`) for every round still running and hand over its record."""
        deadline = time.perf_counter() + timeout_s
        while self.rounds:
            left = deadline - time.perf_counter()
            if left <= 0 or not self._inflight:
                log.warning(
                    "evaluation of step(s) %s did not finish within eval.timeout_s=%.0fs; not logged",
                    [r.step for r in self.rounds],
                    timeout_s,
                )
                for ref in self._inflight:
                    ray.cancel(ref, force=False)
                self._inflight.clear()
                self.rounds.clear()
                return
            ready, _ = ray.wait(self.refs(), num_returns=1, timeout=min(left, 5.0))
            for ref in ready:
                rec = self.collect(ref)
                if rec is not None:
                    on_record(rec)


class EvalDriver:
    """`mode=eval`: the rollout group alone evaluates `model.path` (or random weights), or the
    weights of a checkpoint (`checkpoint.resume`); writes metrics.jsonl and eval_results.json.
    `plan`: what `rlcore.plan.layout.run_plan` decided (its config is the run's)."""

    def __init__(self, plan: Plan):
        self.plan = plan
        cfg = self.cfg = plan.config
        self.env = build_env(cfg.env)
        self.groups = None
        self.step = self.version = 0
        self.startup = StartupPhases()

    def setup(self) -> None:
        cfg = self.cfg
        with self.startup.phase("placing actors"):
            self.groups = place(self.plan, trainer=False)
        with self.startup.phase(f"starting the rollout engines ({cfg.rollout.engine})"):
            get([r.ready.remote() for r in self.groups.rollouts], cfg.rollout.generate_timeout_s, "rollout actor start")
        path = ckpt.resolve_resume(cfg)
        if path is not None:
            self.step = int(ckpt.read_meta(path)["step"])
            self.version = int(ckpt.read_trainer_extra(path)["version"])
            try:
                get(
                    [r.load_checkpoint_weights.remote(str(path), self.version) for r in self.groups.rollouts],
                    cfg.rollout.weight_sync_timeout_s,
                    f"loading weights of {path}",
                )
                # every engine holds the version: a disaggregated group's decode actors may serve it
                get(
                    [r.release_version.remote(self.version) for r in self.groups.rollouts],
                    cfg.rollout.weight_sync_timeout_s,
                    "releasing the loaded version",
                )
            except RunError:
                raise
            except Exception as exc:  # a task error in the actor: the tensors do not fit the model
                cause = str(getattr(exc, "cause", exc)).strip().splitlines()
                raise RunError(
                    f"checkpoint.resume: the weights of {path} do not fit the model built from "
                    f"model.*: {' '.join(line.strip() for line in cause[:2])}"
                ) from exc
            log.info("evaluating checkpoint %s (step %d)", path, self.step)

    def run(self, logger) -> list[dict[str, Any]]:
        episodes = [i for i, role in enumerate(self.plan.roles) if role != "prefill"]  # not a prefill pool
        evaluator = Evaluator(self.cfg.eval, self.cfg.rollout, self.env, self.groups.rollouts, lambda: episodes)
        evaluator.launch(self.step, self.version)
        records: list[dict[str, Any]] = []

        def keep(rec):
            logger.log_eval(rec)
            records.append(rec)

        evaluator.drain(keep, self.cfg.eval.timeout_s)
        if records:
            rec = records[-1]
            per_env = {
                self.env.name: {
                    k.removeprefix(f"eval/{self.env.name}/"): v
                    for k, v in rec.items()
                    if k.startswith(f"eval/{self.env.name}/")
                }
            }
            out = Path(self.cfg.output_dir) / "eval_results.json"
            out.write_text(json.dumps({"step": rec["step"], "environments": per_env}, indent=1))
        return records

    def shutdown(self) -> None:
        if self.groups is not None:
            self.groups.remove()
            self.groups = None
