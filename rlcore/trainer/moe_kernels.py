"""The MoE block's row movement and expert activation, as gathers and fusable pointwise functions.

A block routes ``N`` tokens to ``k`` experts each: the ``N k`` (token, slot) pairs, sorted by
expert, are the rows the experts see. With ``order`` the sort (sorted position -> pair
``n k + i``), ``token = order // k`` and ``inverse`` its inverse permutation (pair -> sorted
position):

- `gather_rows`: ``rows[j] = x[token[j]]``; its backward sums each token's ``k`` row gradients,
  ``dx[n] = sum_i g[inverse[n k + i]]``;
- `sum_rows`: ``y[n] = sum_i rows[inverse[n k + i]]``; its backward is the gather ``g[token]``;
- `permute`: ``x[perm]``, backward ``g[inverse]`` (the expert-parallel regrouping).

Every pass is a gather, so no pass adds into memory another thread also writes: no atomics (what
CUDA's ``index_add``, also autograd's backward of ``index_select``, does with ``k`` rows a token),
the same result on every run, and a token's ``k`` rows are summed in float32 and rounded once
(an atomic bf16 add rounds after each row).

`MoEKernels` holds the functions a block calls; `kernels(compiled=True)` is the same set through
``torch.compile`` (``trainer.compile``): a gather and its ``k``-sum become one kernel, and the
SwiGLU, its clamp (gpt-oss) and the routing-weight scale one kernel forward and one backward.
They are compiled with automatic dynamic shapes, not ``dynamic=True``: these functions have no
parameters to pin the hidden and expert widths, and with every size symbolic inductor's kernels
ran at a quarter of the bandwidth a plain gather reaches (H100 profile, docs/benchmarks.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F


def gather_sum(t: torch.Tensor, index: torch.Tensor, k: int) -> torch.Tensor:
    """``out[n] = sum_{i<k} t[index[n k + i]]`` (float32 sums of a bf16 ``t``, rounded once)."""
    return t.index_select(0, index).view(-1, k, t.shape[-1]).sum(1)


def gather_sum_unrolled(t: torch.Tensor, index: torch.Tensor, k: int) -> torch.Tensor:
    """`gather_sum` as ``k`` gathers added in float32 (or wider): the form compiled (one pointwise kernel
    with ``k`` loads an element; inductor's reduction over ``k = 8`` ran at a quarter of the
    gather's bandwidth on an H100)."""
    rows = index.view(-1, k)
    acc = t.index_select(0, rows[:, 0]).to(torch.promote_types(t.dtype, torch.float32))
    for i in range(1, k):
        acc = acc + t.index_select(0, rows[:, i])
    return acc.to(t.dtype)


def swiglu(gu: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """``silu(g) * u * s`` for ``gu = [g | u]`` (the ``rows`` expert layout), ``s`` [rows] or None."""
    gate, up = gu.chunk(2, dim=-1)
    h = F.silu(gate) * up
    return h if scale is None else h * scale[:, None]


def clamped_swiglu(gu: torch.Tensor, scale: torch.Tensor | None, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's ``(clamp(u, -L, L) + 1) * g' * sigmoid(alpha g')``, ``g' = min(g, L)``, gate and up
    interleaved in the columns, times ``s``."""
    gate = gu[..., ::2].clamp(max=limit)
    up = gu[..., 1::2].clamp(min=-limit, max=limit)
    h = (up + 1) * (gate * torch.sigmoid(gate * alpha))
    return h if scale is None else h * scale[:, None]


@dataclass(frozen=True)
class MoEKernels:
    """The functions a `MoEBlock` calls: eager, or compiled (`kernels`)."""

    gather_sum: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]
    swiglu: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]
    clamped_swiglu: Callable[[torch.Tensor, torch.Tensor | None, float, float], torch.Tensor]


EAGER = MoEKernels(gather_sum, swiglu, clamped_swiglu)
_COMPILED: dict[str, MoEKernels] = {}


def kernels(compiled: bool) -> MoEKernels:
    """The eager functions, or the process's one compiled set (per torch.compile backend, so every
    block shares one graph per function)."""
    if not compiled:
        return EAGER
    from rlcore.trainer import compile as compile_mod  # compile imports the MoE block: import late

    backend = compile_mod.BACKEND
    if backend not in _COMPILED:
        # sizes become symbolic once seen to change (the row count), widths stay static (module docstring)
        fns = (gather_sum_unrolled, swiglu, clamped_swiglu)
        _COMPILED[backend] = MoEKernels(*(compile_mod.compile_fn(f, dynamic=None) for f in fns))
    return _COMPILED[backend]


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, token, inverse, k, gsum):
        ctx.save_for_backward(inverse)
        ctx.k, ctx.gsum = k, gsum
        return x.index_select(0, token)

    @staticmethod
    def backward(ctx, g):
        (inverse,) = ctx.saved_tensors
        return ctx.gsum(g.contiguous(), inverse, ctx.k), None, None, None, None


class _SumRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, token, inverse, k, gsum):
        ctx.save_for_backward(token)
        return gsum(rows, inverse, k)

    @staticmethod
    def backward(ctx, g):
        (token,) = ctx.saved_tensors
        return g.contiguous().index_select(0, token), None, None, None, None


class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, perm, inverse):
        ctx.save_for_backward(inverse)
        return x.index_select(0, perm)

    @staticmethod
    def backward(ctx, g):
        (inverse,) = ctx.saved_tensors
        return g.contiguous().index_select(0, inverse), None, None


def gather_rows(x: torch.Tensor, token: torch.Tensor, inverse: torch.Tensor, k: int, ks: MoEKernels = EAGER):
    """``x[token]`` [N k, H] (each token's ``k`` rows, in expert order); see the module docstring."""
    return _GatherRows.apply(x, token, inverse, k, ks.gather_sum)


def sum_rows(rows: torch.Tensor, token: torch.Tensor, inverse: torch.Tensor, k: int, ks: MoEKernels = EAGER):
    """``y[n] = sum_i rows[inverse[n k + i]]`` [N, H]: each token's ``k`` expert rows summed."""
    return _SumRows.apply(rows.contiguous(), token, inverse, k, ks.gather_sum)


def permute(x: torch.Tensor, perm: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """``x[perm]`` for a permutation ``perm`` whose inverse is ``inverse``; backward ``g[inverse]``."""
    return _Permute.apply(x, perm, inverse)


def inverse_permutation(perm: torch.Tensor) -> torch.Tensor:
    """``inv`` with ``inv[perm[j]] = j`` (one scatter, no sort)."""
    return torch.empty_like(perm).scatter_(0, perm, torch.arange(perm.numel(), device=perm.device, dtype=perm.dtype))
