"""Triton kernels for the chunked logprob head: one read of the logits per pass.

For logits ``z`` [R, V] (the matmul output, bf16 under mixed precision), temperature ``tau``,
``x = z / tau`` and targets ``y``::

    lse_r  = log sum_j exp(x_rj)
    logp_r = x_r[y_r] - lse_r
    H_r    = lse_r - sum_j p_rj x_rj,          p_r = softmax(x_r)

`logprob_entropy` computes all three in a single pass over each row (online softmax: the
running max ``m``, ``s = sum exp(x - m)`` and ``t = sum exp(x - m) x`` are rescaled by
``exp(m_old - m_new)`` when the max grows), so the ``[R, V]`` logits are read once, in their own
dtype, with float32 arithmetic. `logprob_entropy_grad_` overwrites ``z`` with ``dL/dz``::

    dL/dz_rj = (g_r (1[j = y_r] - p_rj) - e_r p_rj (log p_rj + H_r)) / tau

(``g``, ``e`` the incoming gradients of logp and H), one read and one write of ``z``.

Why our own kernels: torch.compile's code for the same math reads the logits three times in
forward (max, sum of exponentials, entropy sum) and materialises a float32 ``[R, V]`` gradient
before casting it: 7.4 ms of a 95 ms Qwen3-0.6B micro-batch on an H200, against 2.3 ms here
(`docs/benchmarks.md`, issue 6, session 5); Liger-style fused cross-entropy kernels compute a *loss's*
gradient inside forward, which needs the loss to be known there, while rlcore's head returns
logprobs and entropies for any objective.

``TRITON_INTERPRET=1`` runs both kernels on CPU tensors (how the CPU tests check them).
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs without Triton: the torch path in logprobs.py is used
    triton = None

BLOCK_V = 4096  # vocabulary columns per iteration: large enough to stream, small enough for registers


def available(z: torch.Tensor) -> bool:
    """Whether the kernels can run on ``z`` (CUDA tensor or Triton's CPU interpreter)."""
    if triton is None:
        return False
    return z.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


if triton is not None:

    @triton.jit
    def _fwd_kernel(z_ptr, stride_z, y_ptr, logp_ptr, ent_ptr, lse_ptr, V, inv_tau, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = z_ptr + row * stride_z
        cols = tl.arange(0, BLOCK)
        m = -float("inf")
        s = 0.0
        t = 0.0
        for start in range(0, V, BLOCK):
            mask = start + cols < V
            x = tl.load(base + start + cols, mask=mask, other=-float("inf")).to(tl.float32) * inv_tau
            m_new = tl.maximum(m, tl.max(x, axis=0))
            scale = tl.exp(m - m_new)
            ex = tl.exp(x - m_new)  # 0 in masked lanes
            s = s * scale + tl.sum(ex, axis=0)
            t = t * scale + tl.sum(ex * tl.where(mask, x, 0.0), axis=0)  # not -inf * 0 in masked lanes
            m = m_new
        lse = m + tl.log(s)
        y = tl.load(y_ptr + row)
        x_y = tl.load(base + y).to(tl.float32) * inv_tau
        tl.store(logp_ptr + row, x_y - lse)
        tl.store(ent_ptr + row, lse - t / s)
        tl.store(lse_ptr + row, lse)

    @triton.jit
    def _bwd_kernel(z_ptr, stride_z, y_ptr, lse_ptr, ent_ptr, g_ptr, e_ptr, V, inv_tau, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < V
        ptr = z_ptr + row * stride_z + cols
        lse = tl.load(lse_ptr + row)
        ent = tl.load(ent_ptr + row)
        g = tl.load(g_ptr + row)
        e = tl.load(e_ptr + row)
        y = tl.load(y_ptr + row)
        logp = tl.load(ptr, mask=mask, other=0.0).to(tl.float32) * inv_tau - lse
        p = tl.exp(logp)
        ds = tl.where(cols == y, g, 0.0) - p * (g + e * (logp + ent))
        tl.store(ptr, (ds * inv_tau).to(z_ptr.dtype.element_ty), mask=mask)


def _check(z: torch.Tensor, *rows: torch.Tensor) -> None:
    if z.dim() != 2 or z.stride(1) != 1:
        raise ValueError(f"logits must be a row-major [R, V] matrix, got shape {tuple(z.shape)} strides {z.stride()}")
    for r in rows:
        if r.shape != (z.shape[0],) or not r.is_contiguous():
            raise ValueError(f"per-row tensors must be contiguous [{z.shape[0]}], got {tuple(r.shape)}")


def logprob_entropy(
    z: torch.Tensor, targets: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(logp, entropy, lse)`` float32 [R] of logits ``z`` [R, V] at ``temperature`` (module
    docstring); ``targets`` int [R] in ``[0, V)``."""
    targets = targets.contiguous()
    _check(z, targets)
    R, V = z.shape
    logp, ent, lse = (torch.empty(R, dtype=torch.float32, device=z.device) for _ in range(3))
    if R:
        _fwd_kernel[(R,)](z, z.stride(0), targets, logp, ent, lse, V, 1.0 / temperature, BLOCK=BLOCK_V, num_warps=8)
    return logp, ent, lse


def logprob_entropy_grad_(
    z: torch.Tensor,
    targets: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor,
    g: torch.Tensor,
    e: torch.Tensor,
    temperature: float,
) -> torch.Tensor:
    """Overwrite logits ``z`` [R, V] with ``dL/dz`` (module docstring) and return it; ``lse``,
    ``entropy``, ``g``, ``e`` float32 [R] (from `logprob_entropy` and the incoming gradients)."""
    targets, lse, entropy, g, e = (t.contiguous() for t in (targets, lse, entropy, g.float(), e.float()))
    _check(z, targets, lse, entropy, g, e)
    R, V = z.shape
    if R:
        block = 2048
        _bwd_kernel[(R, triton.cdiv(V, block))](
            z, z.stride(0), targets, lse, entropy, g, e, V, 1.0 / temperature, BLOCK=block, num_warps=4
        )
    return z
