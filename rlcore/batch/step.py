"""One RL step as data, Ray-free: the driver plans it from metadata, each trainer rank builds its
own micro-batches from the token data it fetched.

    driver  (build_step, GroupMeta only):
        per-sample advantages (algo.*) from rewards and loss-token counts
        [on-policy distillation: the batch's teacher baseline and metrics from per-sample sums]
        the packing plan from sample lengths (token-balanced ranks, micro-batch bins)
        -> one RankWork per data-parallel rank, the loss normaliser, the batch's metrics
    trainer rank (rank_micro_batches, its groups' list[Sample]):
        [per-token distillation advantages] -> packed MicroBatch list (rlcore.batch.packing.materialise)

Plan + materialise give exactly the micro-batches `rlcore.batch.packing.pack_for_ranks` would give
on the whole batch. The driver calls :func:`build_step` and sends each trainer rank its
:class:`RankWork`; tests call both without Ray (a group's `data` handle is then the list itself).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from rlcore.algo.advantages import compute_advantages, nonzero_advantage_groups
from rlcore.algo.distill import batch_baseline, token_advantages
from rlcore.algo.losses import loss_normalizer
from rlcore.batch.packing import Advantage, MicroBatch, materialise, plan_for_ranks
from rlcore.batch.parallel_dims import data_parallel_size
from rlcore.config import AlgoConfig, RunConfig
from rlcore.types import GroupMeta, Sample


@dataclass
class RankWork:
    """One data-parallel rank's part of a step: which token data to fetch and how to pack it."""

    data: list
    """Handles of the groups' token data this rank reads (`GroupMeta.data`), each once."""
    picks: list[tuple[int, int]]
    """Rank-local sample j is sample `picks[j][1]` of the group list `data[picks[j][0]]`."""
    advantages: list[float]
    """The reward advantage of each rank-local sample."""
    bins: list[list[int]]
    """Rank-local sample indices of each micro-batch, in packing order (`[]`: an empty one)."""
    distill: tuple[float, float, float, float] | None = None
    """On-policy distillation: `(kl_coef, reward_coef, baseline, deadband)` of the per-token advantage."""
    groups: list[int] = field(default_factory=list)
    """The batch position of each group of `data`: a sample's key is `(groups[g], k)` for pick
    `(g, k)`, as the driver names it (`sample_places`; empty in a RankWork made by hand)."""


@dataclass
class StepPlan:
    """What one train step needs: the work of each data-parallel rank, and the loss normaliser."""

    ranks: list[RankWork]
    """One per data-parallel rank (context-parallel ranks share their group's)."""
    normalizer: float
    """Global-batch divisor of the summed per-token loss (see `loss_normalizer`)."""
    metrics: dict[str, Any] = field(default_factory=dict)
    """The batch's reward, length and staleness statistics for the step's log line."""


def sample_advantages(batch: list[GroupMeta], algo: AlgoConfig) -> list[float]:
    """Per-sample advantages, in batch order. Groups that lost failed samples can differ in size;
    equal-size groups go through the estimator together (batch-level estimators such as
    REINFORCE++ see the whole batch), unequal ones one group at a time."""

    def tensors(groups):
        return (
            torch.tensor([g.rewards for g in groups], dtype=torch.float32),
            torch.tensor([[s.loss_tokens for s in g.samples] for g in groups], dtype=torch.float32),
        )

    if len({len(g.samples) for g in batch}) == 1:
        rewards, lengths = tensors(batch)
        return compute_advantages(rewards, algo, lengths=lengths).flatten().tolist()
    out: list[float] = []
    for g in batch:
        rewards, lengths = tensors([g])
        out.extend(compute_advantages(rewards, algo, lengths=lengths).flatten().tolist())
    return out


def has_signal(group: GroupMeta) -> bool:
    """False when every reward of the group is equal: its advantages are all zero."""
    return bool(nonzero_advantage_groups(torch.tensor([group.rewards]))[0])


def rank_work(
    batch: list[GroupMeta],
    where: list[tuple[int, int]],
    advantages: list[float],
    bins: list[list[int]],
    distill: tuple[float, float, float, float] | None,
) -> RankWork:
    """The :class:`RankWork` of a rank whose plan is `bins` (indices into the batch's samples;
    sample i is sample `where[i][1]` of group `batch[where[i][0]]`'s token data)."""
    slot: dict[int, int] = {}  # batch position of a group -> its position in RankWork.data
    picks: list[tuple[int, int]] = []
    local_advantages: list[float] = []
    local_bins: list[list[int]] = []
    for b in bins:
        local = []
        for i in b:
            g, k = where[i]
            local.append(len(picks))
            picks.append((slot.setdefault(g, len(slot)), k))
            local_advantages.append(advantages[i])
        local_bins.append(local)
    return RankWork([batch[g].data for g in slot], picks, local_advantages, local_bins, distill, list(slot))


def build_step(batch: list[GroupMeta], cfg: RunConfig, distill: bool = False) -> StepPlan:
    """Advantages, packing plan, normaliser and metrics of `batch`, from metadata alone. With
    `distill`, every sample carries its teacher sums and each rank turns the advantage into a
    per-token one (`rlcore.algo.distill`) with the batch baseline worked out here."""
    samples = [s for g in batch for s in g.samples]
    advantages = sample_advantages(batch, cfg.algo)
    metrics: dict[str, Any] = {}
    spec = None
    if distill:
        if any(s.teacher_sums is None for s in samples):
            raise ValueError("distill: a sample reached the trainer without teacher logprobs")
        t = cfg.teacher
        baseline, distill_metrics = batch_baseline([s.teacher_sums for s in samples], t.kl_baseline)
        spec = (t.kl_coef, t.reward_coef, baseline, t.kl_deadband)
        metrics.update(distill_metrics)
    plan = plan_for_ranks(
        [s.num_tokens for s in samples], data_parallel_size(cfg.trainer), cfg.trainer.micro_batch_tokens
    )
    where = [(gi, s.index) for gi, g in enumerate(batch) for s in g.samples]
    ranks = [rank_work(batch, where, advantages, bins, spec) for bins in plan]
    loss_tokens = sum(s.loss_tokens for s in samples)
    normalizer = loss_normalizer(cfg.algo, loss_tokens, len(samples), cfg.rollout.sampling.max_new_tokens)
    rewards = [s.reward for s in samples]
    metrics.update(
        {
            "reward_mean": sum(rewards) / len(rewards),
            "reward_std": float(torch.tensor(rewards).std(unbiased=False)),
            "completion_len_mean": sum(s.completion_len for s in samples) / len(samples),
            "truncated_frac": sum(s.finish_reason == "length" for s in samples) / len(samples),
            # multi-turn turns whose template re-rendering would not continue the recorded ids (spliced)
            "multiturn_prefix_breaks": sum(s.prefix_breaks for s in samples),
            # groups whose rewards are all equal: no policy-gradient signal (1.0: the step learns
            # nothing), unless a teacher's per-token advantage gives every token one
            "zero_adv_frac": (
                0.0
                if distill and (cfg.teacher.kl_coef or cfg.teacher.top_k)
                else sum(not has_signal(g) for g in batch) / len(batch)
            ),
            "batch_samples": len(samples),
        }
    )
    return StepPlan(ranks, normalizer, metrics)


def rank_micro_batches(work: RankWork, data: list[list[Sample]], pad_token_id: int = 0) -> list[MicroBatch]:
    """A trainer rank's micro-batches: `data[j]` is the fetched token data of `work.data[j]`."""
    samples = [data[g][k] for g, k in work.picks]
    advantages: list[Advantage] = list(work.advantages)
    if work.distill is not None:
        kl_coef, reward_coef, baseline, deadband = work.distill
        for s in samples:
            if s.teacher_logprobs is None:
                raise ValueError("distill: a sample reached the trainer without teacher logprobs")
        advantages = [
            token_advantages(a, s.logprobs, s.teacher_logprobs, s.loss_mask, kl_coef, reward_coef, baseline, deadband)
            for s, a in zip(samples, work.advantages)
        ]
    return materialise(samples, advantages, work.bins, pad_token_id)


def rank_sample_versions(work: RankWork, data: list[list[Sample]]) -> list[torch.Tensor]:
    """Per micro-batch of :func:`rank_micro_batches` (same arguments), the oldest behaviour
    version of each of its samples (long ``[S]``, in ``sample_index`` order; -1 for an empty
    micro-batch's pad sample): the trainer compares it with its own version to tell the
    engine/trainer mismatch from the drift of a stale sample."""
    samples = [data[g][k] for g, k in work.picks]
    return [torch.tensor([samples[i].min_version for i in b] if b else [-1], dtype=torch.long) for b in work.bins]


def sample_places(work: RankWork, keys: list[tuple[int, int]]) -> dict[tuple[int, int], tuple[int, int]]:
    """Where each of `keys` (group position in the batch, sample index) that `work` holds sits in
    the micro-batches of :func:`rank_micro_batches`: (micro-batch, the sample's `sample_index`
    there). Keys of samples other ranks hold are left out."""
    wanted = set(keys)
    places: dict[tuple[int, int], tuple[int, int]] = {}
    for b, members in enumerate(work.bins):
        for j, i in enumerate(members):
            g, k = work.picks[i]
            if (work.groups[g], k) in wanted:
                places[work.groups[g], k] = (b, j)
    return places
