"""Evaluation: an environment's eval split on the rollout group -> mean reward and pass@k.

`Evaluator` runs an evaluation *round* (the first `eval.num_tasks` tasks of the eval split,
`eval.samples_per_task` completions each) as ordinary generate requests on the rollout actors,
at most one eval request per actor at a time, so an evaluation during RL shares the engines with
training requests instead of stopping them. The driver's event loop waits on `refs()` next to
its own refs and hands finished ones to `collect`, which returns the round's metrics record
once its last request is in.

Every eval request carries a seed derived from (`eval.seed`, task index): each evaluation of a
run samples with the same randomness (rounds at different steps are comparable) and never
consumes the training requests' RNG.

A round launched after step s is logged with `"step": s`; in asynchronous runs a weight update
may land while it decodes, so `eval/version_min`/`eval/version_max` report the policy versions
that produced its tokens.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from math import comb
from typing import Any, Callable

from actors.remote import RunError, get
from rlcore.seeding import derive_seed
from rlcore.startup import StartupPhases
from rlcore.types import Group, Task

log = logging.getLogger("rlcore")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k (Chen et al., 2021): the probability that at least one of `k` completions
    drawn without replacement from `n`, of which `c` are correct, is correct:
    ``1 - C(n-c, k) / C(n, k)``. Needs ``0 <= c <= n`` and ``1 <= k <= n``."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def summarize(groups: list[Group], ks: list[int], threshold: float, prefix: str = "eval/") -> dict[str, float]:
    """Metrics of one round. A failed sample counts as incorrect for pass@k (n stays the number
    of completions asked for) and is left out of the reward mean (its count is reported)."""
    rewards, lengths, versions = [], [], []
    failed = 0
    passes = {k: [] for k in ks}
    for g in groups:
        n = len(g.samples)
        c = sum(1 for s in g.samples if not s.failed and s.reward >= threshold)
        failed += sum(1 for s in g.samples if s.failed)
        for s in g.samples:
            if not s.failed:
                rewards.append(s.reward)
                lengths.append(len(s.completion_ids))
                versions.extend(v for v, m in zip(s.versions, s.loss_mask) if m)
        for k in ks:
            if n >= k:
                passes[k].append(pass_at_k(n, c, k))
    total = sum(len(g.samples) for g in groups)
    out = {
        f"{prefix}reward_mean": sum(rewards) / len(rewards) if rewards else 0.0,
        f"{prefix}completion_len_mean": sum(lengths) / len(lengths) if lengths else 0.0,
        f"{prefix}num_tasks": len(groups),
        f"{prefix}num_samples": total,
        f"{prefix}failed_frac": failed / total if total else 0.0,
    }
    for k, vals in passes.items():
        out[f"{prefix}pass@{k}"] = sum(vals) / len(vals) if vals else 0.0
    if versions:
        out[f"{prefix}version_min"], out[f"{prefix}version_max"] = min(versions), max(versions)
    return out


def eval_tasks(env, cfg) -> list[tuple[int, Task]]:
    """(index, task) of the evaluated part of the eval split: all of it when `eval.num_tasks` is
    0, else the first `num_tasks` (capped at the environment's `eval_size` when it declares one)."""
    e = cfg.eval
    size = getattr(env, "eval_size", None)
    n = e.num_tasks or size
    if n is None:
        raise ValueError(f"eval.num_tasks: environment {env.name!r} declares no eval split size; set num_tasks > 0")
    if size is not None and n > size:
        log.warning("eval.num_tasks=%d exceeds the eval split of %s (%d tasks): evaluating %d", n, env.name, size, size)
        n = size
    return [(i, env.make_task(i, e.split)) for i in range(n)]


def sampling_overrides(cfg) -> dict[str, Any]:
    e, s = cfg.eval, cfg.rollout.sampling
    return {"temperature": s.temperature if e.temperature is None else e.temperature,
            "max_new_tokens": s.max_new_tokens if e.max_new_tokens is None else e.max_new_tokens}


@dataclass
class Round:
    """One evaluation in progress."""

    step: int
    version: int
    started: float
    queued: list[list[tuple[int, Task]]]
    results: dict[int, list[Group]] = field(default_factory=dict)
    """Finished requests by chunk number (kept in task order for the summary)."""
    outstanding: int = 0


class Evaluator:
    """Evaluation rounds on the rollout actors, interleaved with whatever else they run."""

    def __init__(self, cfg, env, rollouts: list):
        import ray
        self.ray = ray
        self.cfg, self.env, self.rollouts = cfg, env, rollouts
        self.tasks = eval_tasks(env, cfg)
        per = cfg.rollout.tasks_per_request
        self.chunks = [self.tasks[i:i + per] for i in range(0, len(self.tasks), per)]
        self.sampling = sampling_overrides(cfg)
        self.rounds: list[Round] = []
        self._inflight: dict[Any, tuple[Round, int, int]] = {}  # ref -> (round, chunk, actor)

    def due(self, step: int, final: bool) -> bool:
        n = self.cfg.eval.every_n_steps
        return n > 0 and (step % n == 0 or final)

    def launch(self, step: int, version: int) -> None:
        """Start a round for the policy of `step` (queued behind a round still running)."""
        self.rounds.append(Round(step, version, time.perf_counter(), list(enumerate(self.chunks))))
        self.pump()

    def pump(self) -> None:
        """Submit queued chunks, oldest round first, keeping one eval request per actor."""
        busy = {actor for _, _, actor in self._inflight.values()}
        free = [i for i in range(len(self.rollouts)) if i not in busy]
        e = self.cfg.eval
        for rnd in self.rounds:
            while rnd.queued and free:
                chunk_no, chunk = rnd.queued.pop(0)
                actor = free.pop(0)
                first = chunk[0][0]
                ref = self.rollouts[actor].generate_groups.remote(
                    [t for _, t in chunk], e.samples_per_task, e.split,
                    derive_seed(e.seed, e.split, first), self.sampling)
                self._inflight[ref] = (rnd, chunk_no, actor)
                rnd.outstanding += 1

    def refs(self) -> list:
        return list(self._inflight)

    def owns(self, ref) -> bool:
        return ref in self._inflight

    @property
    def busy(self) -> bool:
        return bool(self.rounds)

    def collect(self, ref) -> dict[str, Any] | None:
        """Take a finished eval request; returns the round's record when the round is complete."""
        rnd, chunk_no, actor = self._inflight.pop(ref)
        rnd.outstanding -= 1
        try:
            rnd.results[chunk_no] = self.ray.get(ref, timeout=0)
        except self.ray.exceptions.RayError as exc:
            log.warning("eval request on rollout actor %d failed (%s); its tasks count as failed", actor,
                        type(exc).__name__)
            from actors.rollout import failed_groups
            rnd.results[chunk_no] = failed_groups([t for _, t in self.chunks[chunk_no]],
                                                  self.cfg.eval.samples_per_task, str(exc))
        self.pump()
        if rnd.queued or rnd.outstanding:
            return None
        self.rounds.remove(rnd)
        self.pump()
        return self.record(rnd)

    def record(self, rnd: Round) -> dict[str, Any]:
        groups = [g for i in sorted(rnd.results) for g in rnd.results[i]]
        e = self.cfg.eval
        rec: dict[str, Any] = {"step": rnd.step, "eval/policy_version": rnd.version,
                               "eval/time_s": time.perf_counter() - rnd.started}
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
                log.warning("evaluation of step(s) %s did not finish within eval.timeout_s=%.0fs; not logged",
                            [r.step for r in self.rounds], timeout_s)
                for ref in self._inflight:
                    self.ray.cancel(ref, force=False)
                self._inflight.clear()
                self.rounds.clear()
                return
            ready, _ = self.ray.wait(self.refs(), num_returns=1, timeout=min(left, 5.0))
            for ref in ready:
                rec = self.collect(ref)
                if rec is not None:
                    on_record(rec)


class EvalDriver:
    """`mode=eval`: the rollout group alone evaluates `model.path` (or random weights), or the
    weights of a checkpoint (`checkpoint.resume`); writes metrics.jsonl and eval_results.json."""

    def __init__(self, cfg):
        from rlcore.envs import make_env
        self.cfg = cfg
        self.env = make_env(cfg.env.name, dict(cfg.env.args), cfg.env.seed)
        self.groups = None
        self.step = self.version = 0
        self.startup = StartupPhases()

    def setup(self) -> None:
        from actors.groups import place
        from rlcore import checkpoint as ckpt
        cfg = self.cfg
        with self.startup.phase("placing actors"):
            self.groups = place(cfg, trainer=False)
        with self.startup.phase(f"starting the rollout engines ({cfg.rollout.engine})"):
            get([r.ready.remote() for r in self.groups.rollouts], cfg.rollout.generate_timeout_s, "rollout actor start")
        path = ckpt.resolve_resume(cfg)
        if path is not None:
            self.step = int(ckpt.read_meta(path)["step"])
            self.version = int(ckpt.read_trainer_extra(path)["version"])
            try:
                get([r.load_checkpoint_weights.remote(str(path), self.version) for r in self.groups.rollouts],
                    cfg.rollout.weight_sync_timeout_s, f"loading weights of {path}")
            except RunError:
                raise
            except Exception as exc:  # a task error in the actor: the tensors do not fit the model
                cause = str(getattr(exc, "cause", exc)).strip().splitlines()
                raise RunError(f"checkpoint.resume: the weights of {path} do not fit the model built from "
                               f"model.*: {' '.join(line.strip() for line in cause[:2])}") from exc
            log.info("evaluating checkpoint %s (step %d)", path, self.step)

    def run(self, logger) -> list[dict[str, Any]]:
        import json
        from pathlib import Path
        evaluator = Evaluator(self.cfg, self.env, self.groups.rollouts)
        evaluator.launch(self.step, self.version)
        records: list[dict[str, Any]] = []

        def keep(rec):
            logger.log_eval(rec)
            records.append(rec)
        evaluator.drain(keep, self.cfg.eval.timeout_s)
        if records:
            rec = records[-1]
            per_env = {self.env.name: {k.removeprefix(f"eval/{self.env.name}/"): v for k, v in rec.items()
                                       if k.startswith(f"eval/{self.env.name}/")}}
            out = Path(self.cfg.output_dir) / "eval_results.json"
            out.write_text(json.dumps({"step": rec["step"], "environments": per_env}, indent=1))
        return records

    def shutdown(self) -> None:
        if self.groups is not None:
            self.groups.remove()
            self.groups = None
