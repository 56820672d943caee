"""Reductions over the tokens of a packed micro-batch: per sample, and masked extrema.

A packed micro-batch is a flat ``[T]`` sequence of several samples' tokens; ``sample_index`` ``[T]``
(long) says which sample (0..S-1 within the micro-batch, S <= T) each token belongs to. Only tokens in the
loss mask enter the per-sample reductions, so tokens outside it (prompt, padding, environment
tokens) may carry any index, including -1.
"""

from __future__ import annotations

import torch


def _valid_index(sample_index: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Index safe for ``index_add`` (masked-out tokens moved to 0) and a bound on the number of
    samples. The bound is T, not ``max + 1``: a micro-batch has at most T samples, and reading the
    max would cost a device sync."""
    idx = torch.where(mask, sample_index, torch.zeros_like(sample_index)).long()
    return idx, idx.numel()


def per_sample_sum(values: torch.Tensor, sample_index: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``out[s] = sum_t mask_t * values_t`` over tokens t of sample s; shape ``[S]``. Differentiable."""
    idx, num_samples = _valid_index(sample_index, mask)
    masked = torch.where(mask, values, torch.zeros_like(values))
    return masked.new_zeros(num_samples).index_add(0, idx, masked)


def per_sample_mean(values: torch.Tensor, sample_index: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` over each sample's masked tokens, broadcast back to ``[T]``.

    A sample with no masked tokens gets 0 (it contributes nothing anyway).
    """
    idx, _ = _valid_index(sample_index, mask)
    sums = per_sample_sum(values, sample_index, mask)
    counts = per_sample_sum(torch.ones_like(values), sample_index, mask).clamp(min=1.0)
    return (sums / counts)[idx]


def per_sample_count(sample_index: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Number of masked tokens of each token's sample, broadcast back to ``[T]`` (float, >= 1)."""
    idx, _ = _valid_index(sample_index, mask)
    ones = torch.ones(sample_index.shape, dtype=torch.float32, device=sample_index.device)
    return per_sample_sum(ones, sample_index, mask).clamp(min=1.0)[idx]


def masked_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``sum_t mask_t * values_t``, immune to inf/nan in masked-out positions."""
    return torch.where(mask, values, torch.zeros_like(values)).sum()


def masked_max(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Max over masked tokens; -inf when none is masked: the identity of max, so a caller that
    reduces over micro-batches and ranks with max is unaffected by an empty one."""
    if values.numel() == 0:
        return values.new_full((), -torch.inf)
    return torch.where(mask, values, -torch.inf).max()


def masked_min(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Min over masked tokens; +inf (the identity of min) when none is masked."""
    if values.numel() == 0:
        return values.new_full((), torch.inf)
    return torch.where(mask, values, torch.inf).min()
