"""Evaluation: an environment's eval split on the rollout group -> mean reward and pass@k. This
module holds the pure parts (pass@k, the summary, the task list); the rounds run in
`actors/evaluation.py`.

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
that produced its tokens. A synchronous run's next sync waits for it instead (at most
`eval.timeout_s`, `actors.lifecycle.StepHooks.holds_sync`): every token of the round comes from
its step's policy, so a run and its resume evaluate alike whatever the timing.
"""

from __future__ import annotations

import logging
from math import comb
from typing import Any

from rlcore.config import EvalConfig, SamplingConfig
from rlcore.types import GroupMeta, Task

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


def summarize(groups: list[GroupMeta], ks: list[int], threshold: float, prefix: str = "eval/") -> dict[str, float]:
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
                lengths.append(s.completion_len)
                if s.max_version >= 0:  # it has policy tokens
                    versions += [s.min_version, s.max_version]
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


def eval_tasks(env, e: EvalConfig) -> list[tuple[int, Task]]:
    """(index, task) of the evaluated part of the eval split: all of it when `eval.num_tasks` is
    0, else the first `num_tasks` (capped at the environment's `eval_size` when it declares one)."""
    size = getattr(env, "eval_size", None)
    n = e.num_tasks or size
    if n is None:
        raise ValueError(f"eval.num_tasks: environment {env.name!r} declares no eval split size; set num_tasks > 0")
    if size is not None and n > size:
        log.warning("eval.num_tasks=%d exceeds the eval split of %s (%d tasks): evaluating %d", n, env.name, size, size)
        n = size
    return [(i, env.make_task(i, e.split)) for i in range(n)]


def sampling_overrides(e: EvalConfig, s: SamplingConfig) -> dict[str, Any]:
    """The rollout's sampling (`rollout.sampling`) with what `eval` sets in its place."""
    return {
        "temperature": s.temperature if e.temperature is None else e.temperature,
        "max_new_tokens": s.max_new_tokens if e.max_new_tokens is None else e.max_new_tokens,
    }
