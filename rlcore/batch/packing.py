"""Turn scored samples into packed, rank-balanced micro-batches for the trainer.

A micro-batch is one row of concatenated samples (no padding compute): ``position_ids`` restart
at 0 for every sample, which transformers turns into a block-diagonal causal mask (and flash
attention into variable-length attention), so samples never attend to each other.

Per-token arrays are aligned to *prediction positions*: position ``i`` holds what is needed to
score token ``i + 1`` of the same sample (its id in ``targets``, the engine's behaviour logprob,
the sample's advantage, and whether it is trained on). The last position of each sample predicts
nothing and is masked.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from rlcore.batch.routing import packed_routing
from rlcore.types import Sample


@dataclass
class MicroBatch:
    """One packed row; all tensors are 1-D of length T."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    targets: torch.Tensor
    behaviour_logprobs: torch.Tensor
    advantages: torch.Tensor
    loss_mask: torch.Tensor
    sample_index: torch.Tensor
    """Index of the sample (within this micro-batch) each position belongs to."""
    num_samples: int
    images: list = field(default_factory=list)
    """uint8 images of the samples, concatenated in sample order (vision-language policies; the
    trainer turns them into pixel values: uint8 keeps the object-store payload small)."""
    teacher_top_k_ids: torch.Tensor | None = None
    """`teacher.top_k`: long [T, k], the teacher's k likeliest next tokens at each prediction
    position of a completion token (0 elsewhere); None without top-k distillation."""
    teacher_top_k_logprobs: torch.Tensor | None = None
    """float32 [T, k]: their teacher logprobs (0 elsewhere)."""
    routed_experts: torch.Tensor | None = None
    """Routing replay: int16 [T, layers, top_k], the engine's experts of each input position, -1
    where the trainer routes itself (`rlcore.batch.routing.packed_routing`); None without replay."""

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())


Advantage = float | list[float]
"""A sample's advantage: one number for all its tokens, or one per completion token (on-policy
distillation's per-token advantages)."""


def sample_arrays(sample: Sample, advantage: Advantage) -> dict[str, list]:
    """The per-position lists of one sample (see the module docstring for the alignment)."""
    tokens = sample.prompt_ids + sample.completion_ids
    n, p = len(tokens), len(sample.prompt_ids)
    mask = [0.0] * n
    behaviour = [0.0] * n
    for k, (m, lp) in enumerate(zip(sample.loss_mask, sample.logprobs)):
        mask[p + k - 1] = float(m)
        behaviour[p + k - 1] = float(lp)
    if isinstance(advantage, (int, float)):
        advantages = [float(advantage)] * n
    else:
        if len(advantage) != len(sample.completion_ids):
            raise ValueError(
                f"{len(advantage)} per-token advantages for {len(sample.completion_ids)} completion tokens"
            )
        advantages = [0.0] * n
        for k, a in enumerate(advantage):
            advantages[p + k - 1] = float(a)
    return {
        "input_ids": tokens,
        "position_ids": list(range(n)),
        "targets": tokens[1:] + [0],
        "behaviour_logprobs": behaviour,
        "advantages": advantages,
        "loss_mask": mask,
    }


_LONG_KEYS = ("input_ids", "position_ids", "targets")
_FLOAT_KEYS = ("behaviour_logprobs", "advantages", "loss_mask")


def sample_columns(sample: Sample, advantage: Advantage) -> dict[str, np.ndarray]:
    """:func:`sample_arrays` as numpy arrays, filled by slices instead of a per-token Python
    loop (the driver packs every sample of a step: this is most of its own time per sample)."""
    p, c = len(sample.prompt_ids), len(sample.completion_ids)
    if p == 0:  # no prompt: the first completion token has no predicting position (as sample_arrays)
        arrays = sample_arrays(sample, advantage)
        return {k: np.asarray(v, dtype=np.int64 if k in _LONG_KEYS else np.float32) for k, v in arrays.items()}
    n = p + c
    tokens = np.asarray(sample.prompt_ids + sample.completion_ids, dtype=np.int64)
    targets = np.zeros(n, dtype=np.int64)
    targets[:-1] = tokens[1:]
    m = min(len(sample.loss_mask), len(sample.logprobs))
    mask = np.zeros(n, dtype=np.float32)
    mask[p - 1 : p - 1 + m] = sample.loss_mask[:m]
    behaviour = np.zeros(n, dtype=np.float32)
    behaviour[p - 1 : p - 1 + m] = sample.logprobs[:m]
    if isinstance(advantage, (int, float)):
        advantages = np.full(n, float(advantage), dtype=np.float32)
    else:
        if len(advantage) != c:
            raise ValueError(f"{len(advantage)} per-token advantages for {c} completion tokens")
        advantages = np.zeros(n, dtype=np.float32)
        advantages[p - 1 : p - 1 + c] = advantage
    return {
        "input_ids": tokens,
        "position_ids": np.arange(n, dtype=np.int64),
        "targets": targets,
        "behaviour_logprobs": behaviour,
        "advantages": advantages,
        "loss_mask": mask,
    }


def make_micro_batch(samples: list[Sample], advantages: list[Advantage]) -> MicroBatch:
    """One packed row of `samples` (columns of :func:`sample_arrays`, concatenated in order)."""
    columns = [sample_columns(s, a) for s, a in zip(samples, advantages)] or [
        {k: np.zeros(0, dtype=np.int64 if k in _LONG_KEYS else np.float32) for k in (*_LONG_KEYS, *_FLOAT_KEYS)}
    ]
    tensors = {k: torch.from_numpy(np.concatenate([col[k] for col in columns])) for k in (*_LONG_KEYS, *_FLOAT_KEYS)}
    index = np.concatenate([np.full(len(col["input_ids"]), j, dtype=np.int64) for j, col in enumerate(columns)])
    images = [img for s in samples for img in s.images]
    top_ids, top_logprobs = packed_top_k(samples, [len(col["input_ids"]) for col in columns])
    return MicroBatch(
        **tensors,
        sample_index=torch.from_numpy(index),
        num_samples=len(samples),
        images=images,
        routed_experts=packed_routing(samples),
        teacher_top_k_ids=top_ids,
        teacher_top_k_logprobs=top_logprobs,
    )


def packed_top_k(samples: list[Sample], lengths: list[int]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The teacher's top-k of `samples` packed like :func:`make_micro_batch`'s columns
    (`lengths`: each sample's row length): completion token j's top-k at position
    ``len(prompt) + j - 1``, zeros elsewhere; (None, None) when no sample carries any."""
    tops = [s.teacher_top_k_ids for s in samples]
    if all(t is None for t in tops):
        return None, None
    widths = {t.shape[1] for t in tops if t is not None}
    if len(widths) != 1 or any(t is None for t in tops):
        raise ValueError(
            f"teacher top-k: samples of one micro-batch carry widths {sorted(widths)}"
            + (" and none" if any(t is None for t in tops) else "")
        )
    k = widths.pop()
    ids = np.zeros((sum(lengths), k), dtype=np.int64)
    logprobs = np.zeros((sum(lengths), k), dtype=np.float32)
    offset = 0
    for s, n in zip(samples, lengths):
        rows = offset + len(s.prompt_ids) - 1 + np.arange(len(s.completion_ids))
        keep = rows >= offset  # no prompt: the first completion token has no predicting position
        ids[rows[keep]] = np.asarray(s.teacher_top_k_ids)[keep]
        logprobs[rows[keep]] = np.asarray(s.teacher_top_k_logprobs)[keep]
        offset += n
    return torch.from_numpy(ids), torch.from_numpy(logprobs)


def empty_micro_batch(pad_token_id: int = 0) -> MicroBatch:
    """A one-token micro-batch with nothing to train on: keeps ranks in collective lock-step
    when one rank has fewer micro-batches than another."""
    return make_micro_batch(
        [Sample(prompt_ids=[pad_token_id], completion_ids=[], logprobs=[], versions=[], loss_mask=[])], [0.0]
    )


def balance_across_ranks(lengths: list[int], num_ranks: int) -> list[list[int]]:
    """Assign sample indices to ranks so token counts are balanced: longest first, each to the
    currently lightest rank (LPT scheduling; within 4/3 of optimal)."""
    loads = [0] * num_ranks
    assignment: list[list[int]] = [[] for _ in range(num_ranks)]
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        r = min(range(num_ranks), key=lambda r: loads[r])
        assignment[r].append(i)
        loads[r] += lengths[i]
    return assignment


def pack_first_fit(lengths: list[int], indices: list[int], budget: int) -> list[list[int]]:
    """Pack `indices` into bins of at most `budget` tokens (first-fit decreasing); a sample longer
    than the budget gets a bin of its own."""
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(indices, key=lambda i: -lengths[i]):
        for b, load in enumerate(loads):
            if load + lengths[i] <= budget:
                bins[b].append(i)
                loads[b] += lengths[i]
                break
        else:
            bins.append([i])
            loads.append(lengths[i])
    return bins


def plan_for_ranks(lengths: list[int], num_ranks: int, micro_batch_tokens: int) -> list[list[list[int]]]:
    """The packing plan, from sample lengths alone: per rank, per micro-batch, the sample indices
    (token-balanced over ranks by :func:`balance_across_ranks`, first-fit-decreasing bins of at
    most `micro_batch_tokens` by :func:`pack_first_fit`). Every rank gets the same number of
    micro-batches: a rank with fewer gets empty ones (`[]`, an :func:`empty_micro_batch`)."""
    per_rank = [
        pack_first_fit(lengths, indices, micro_batch_tokens) for indices in balance_across_ranks(lengths, num_ranks)
    ]
    most = max(len(r) for r in per_rank)
    for r in per_rank:
        r.extend([] for _ in range(most - len(r)))
    return per_rank


def materialise(
    samples: list[Sample], advantages: list[Advantage], bins: list[list[int]], pad_token_id: int = 0
) -> list[MicroBatch]:
    """One rank's micro-batches from its plan: bin `b` packs `samples[i]` for i in `bins[b]`, in
    order; an empty bin is an :func:`empty_micro_batch`."""
    return [
        make_micro_batch([samples[i] for i in b], [advantages[i] for i in b]) if b else empty_micro_batch(pad_token_id)
        for b in bins
    ]


def pack_for_ranks(
    samples: list[Sample], advantages: list[Advantage], num_ranks: int, micro_batch_tokens: int, pad_token_id: int = 0
) -> list[list[MicroBatch]]:
    """Split samples over ranks (token-balanced), pack each rank's share into micro-batches of at
    most `micro_batch_tokens`, and pad every rank to the same number of micro-batches
    (:func:`plan_for_ranks`, then :func:`materialise` per rank)."""
    plan = plan_for_ranks([s.num_tokens for s in samples], num_ranks, micro_batch_tokens)
    return [materialise(samples, advantages, bins, pad_token_id) for bins in plan]
