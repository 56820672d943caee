"""One RL step as data, Ray-free: a batch of scored groups in, per-rank shards out.

    groups -> per-sample advantages (algo.*) [-> per-token distillation advantages (teacher.*)]
           -> token-balanced packing into one shard of micro-batches per data-parallel rank
           -> the loss normaliser over the global batch, and the batch's metrics

The RL driver calls :func:`build_step` and hands each trainer rank its shard; tests call it
without Ray.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from rlcore.algo.advantages import compute_advantages, nonzero_advantage_groups
from rlcore.algo.distill import batch_token_advantages
from rlcore.algo.losses import loss_normalizer
from rlcore.config import AlgoConfig, RunConfig
from rlcore.packing import MicroBatch, pack_for_ranks
from rlcore.trainer.parallel import data_parallel_size
from rlcore.types import Group


@dataclass
class StepBatch:
    """What one train step needs: a shard per data-parallel rank, and the loss normaliser."""

    shards: list[list[MicroBatch]]
    """Micro-batches of each data-parallel rank (context-parallel ranks share their group's)."""
    normalizer: float
    """Global-batch divisor of the summed per-token loss (see `loss_normalizer`)."""
    metrics: dict[str, Any] = field(default_factory=dict)
    """The batch's reward, length and staleness statistics for the step's log line."""


def sample_advantages(batch: list[Group], algo: AlgoConfig) -> list[float]:
    """Per-sample advantages, in batch order. Groups that lost failed samples can differ in size;
    equal-size groups go through the estimator together (batch-level estimators such as
    REINFORCE++ see the whole batch), unequal ones one group at a time."""
    def tensors(groups):
        return (torch.tensor([g.rewards for g in groups], dtype=torch.float32),
                torch.tensor([[sum(s.loss_mask) for s in g.samples] for g in groups], dtype=torch.float32))
    if len({len(g.samples) for g in batch}) == 1:
        rewards, lengths = tensors(batch)
        return compute_advantages(rewards, algo, lengths=lengths).flatten().tolist()
    out: list[float] = []
    for g in batch:
        rewards, lengths = tensors([g])
        out.extend(compute_advantages(rewards, algo, lengths=lengths).flatten().tolist())
    return out


def has_signal(group: Group) -> bool:
    """False when every reward of the group is equal: its advantages are all zero."""
    return bool(nonzero_advantage_groups(torch.tensor([group.rewards]))[0])


def build_step(batch: list[Group], cfg: RunConfig, distill: bool = False) -> StepBatch:
    """Advantages, packing and normaliser for `batch`. With `distill`, every sample carries the
    teacher's logprobs and the advantage becomes per-token (`rlcore.algo.distill`)."""
    samples = [s for g in batch for s in g.samples]
    advantages = sample_advantages(batch, cfg.algo)
    metrics: dict[str, Any] = {}
    if distill:
        t = cfg.teacher
        advantages, distill_metrics = batch_token_advantages(samples, advantages, t.kl_coef, t.reward_coef,
                                                             t.kl_baseline)
        metrics.update(distill_metrics)
    shards = pack_for_ranks(samples, advantages, data_parallel_size(cfg.trainer), cfg.trainer.micro_batch_tokens)
    loss_tokens = sum(int(mb.loss_mask.sum()) for shard in shards for mb in shard)
    normalizer = loss_normalizer(cfg.algo, loss_tokens, len(samples), cfg.rollout.sampling.max_new_tokens)
    rewards = [s.reward for s in samples]
    metrics.update({
        "reward_mean": sum(rewards) / len(rewards),
        "reward_std": float(torch.tensor(rewards).std(unbiased=False)),
        "completion_len_mean": sum(len(s.completion_ids) for s in samples) / len(samples),
        "truncated_frac": sum(s.finish_reason == "length" for s in samples) / len(samples),
        # multi-turn turns whose template re-rendering would not continue the recorded ids (spliced)
        "multiturn_prefix_breaks": sum(s.prefix_breaks for s in samples),
        # groups whose rewards are all equal: no policy-gradient signal (1.0: the step learns
        # nothing), unless a teacher's per-token advantage gives every token one
        "zero_adv_frac": 0.0 if distill and cfg.teacher.kl_coef else sum(not has_signal(g) for g in batch) / len(batch),
        "batch_samples": len(samples),
    })
    return StepBatch(shards, normalizer, metrics)
