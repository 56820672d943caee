"""Context parallelism of one packed micro-batch over the ``cp`` ranks of a data-parallel group.

Contract: the ``cp`` ranks of a group receive the *same* micro-batch. Each pads it to a multiple
of ``cp`` (the pad is its own trailing sample, never trained on), keeps the contiguous slice
``[c * L, (c + 1) * L)`` of ids / positions / targets, runs the model on it (attention sees
the whole row through Ulysses, see `rlcore.trainer.attention`) and computes logprobs of its own
tokens. `gather_sequence` then assembles the full ``[T]`` logprobs on every ``cp`` rank, so the
loss (which may couple tokens of a sample, e.g. sequence-level ratios) is computed identically on
all of them.

Gradient: with the same loss ``L`` on every ``cp`` rank, ``dL/dlogp`` is the same full vector
everywhere, so the backward of the gather is just "take my slice" (no communication). Each rank's
parameter gradients are then its tokens' share of ``dL/dtheta`` and FSDP2's sum over ranks
completes it (see the gradient-scale contract in `rlcore.trainer.parallel`). Per-step metric sums
are counted once per ``cp`` rank and must be divided by ``cp``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def pad_to_multiple(
    input_ids: torch.Tensor, position_ids: torch.Tensor, targets: torch.Tensor, multiple: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Append ``(-T) mod multiple`` pad tokens forming one extra sample (positions 0, 1, ...)."""
    pad = (-input_ids.numel()) % multiple
    if pad == 0:
        return input_ids, position_ids, targets
    zeros = input_ids.new_zeros(pad)
    return (
        torch.cat([input_ids, zeros]),
        torch.cat([position_ids, torch.arange(pad, dtype=position_ids.dtype, device=position_ids.device)]),
        torch.cat([targets, zeros]),
    )


def local_slice(x: torch.Tensor, cp_rank: int, cp: int) -> torch.Tensor:
    L = x.shape[0] // cp
    return x[cp_rank * L : (cp_rank + 1) * L]


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup):
        cp = dist.get_world_size(group)
        ctx.rank, ctx.L = dist.get_rank(group), x.shape[0]
        out = x.new_empty((cp * x.shape[0], *x.shape[1:]))
        dist.all_gather_into_tensor(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # the downstream loss is replicated across the cp ranks: my slice of its gradient is mine
        return grad[ctx.rank * ctx.L : (ctx.rank + 1) * ctx.L].contiguous(), None


def gather_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """All-gather sequence slices ``[L, ...]`` -> ``[cp * L, ...]`` (see module docstring for
    the gradient contract)."""
    return _GatherSequence.apply(x, group)
