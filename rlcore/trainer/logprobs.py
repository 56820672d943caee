"""Token logprobs and entropies straight from hidden states, chunk by chunk.

For hidden states ``h`` [T, H], head weight ``W`` [V, H] and temperature ``tau``::

    s_t = (h_t W^T + b) / tau                   logits of position t, [V]
    lse_t = log sum_j exp(s_tj)
    logp_t = s_t[y_t] - lse_t                   logprob of the target y_t
    H_t = lse_t - sum_j p_tj s_tj               entropy, p_t = softmax(s_t)

Gradients (``g``, ``e`` the incoming grads of logp and H)::

    dlogp_t/ds_tj = 1[j = y_t] - p_tj
    dH_t/ds_tj    = -p_tj (log p_tj + H_t)
    dL/ds_t       = g_t (onehot(y_t) - p_t) - e_t p_t (log p_t + H_t)
    dL/dh_t = (dL/ds_t / tau) W,    dL/dW = sum_t (dL/ds_t / tau)^T h_t

Forward keeps ``lse`` and ``H`` per token and, within a byte budget, the compute-dtype logits
(bf16 ``T x V``: 2.5 GB at 8k x 152k); otherwise backward recomputes each chunk's logits. No
float32 ``T x V`` tensor exists (5 GB at 8k x 152k): on CUDA the chunk math runs in the Triton
kernels of `logprob_kernels`, elsewhere in float32 chunks (1.2 GB at 2048-token chunks).

The head is installed in place of ``model.lm_head`` (`LogprobHead`) so the projection runs
inside the root FSDP2 unit's forward (the weight is unsharded there, and tied embeddings stay
tied); outside a `logprob_request` it behaves like the plain linear head.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from rlcore.trainer import compile as rc
from rlcore.trainer import logprob_kernels as lk


def plain_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: logprob of each target and entropy from full ``[T, V]`` logits."""
    logp = torch.log_softmax(_upcast(logits) / temperature, dim=-1)
    taken = logp.gather(-1, targets[:, None]).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return taken, entropy


def _upcast(x: torch.Tensor) -> torch.Tensor:
    """Softmax algebra in at least float32 (float64 stays float64, for exact tests)."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def _chunk_logits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, temperature: float) -> torch.Tensor:
    # matmul in the compute dtype (bf16 under mixed precision), softmax algebra in float32
    return _upcast(F.linear(h, weight, bias)) / temperature


def _forward_chunk(h, weight, bias, targets, temperature: float):
    """``(logp, entropy, lse)`` of one chunk of positions."""
    z = _chunk_logits(h, weight, bias, temperature)
    lse = torch.logsumexp(z, dim=-1)
    logp = z.gather(-1, targets[:, None]).squeeze(-1) - lse
    entropy = lse - (torch.softmax(z, dim=-1) * z).sum(-1)
    return logp, entropy, lse


def _backward_chunk(h, weight, bias, targets, lse, entropy, g, e, temperature: float):
    """``dL/dz`` of one chunk (z = h W^T + b, pre-temperature logits) in the hidden dtype."""
    z = _chunk_logits(h, weight, bias, temperature)
    logp = z - lse[:, None]
    p = logp.exp()
    ds = -p * (g[:, None] + e[:, None] * (logp + entropy[:, None]))
    ds = ds.scatter_add(-1, targets[:, None], g[:, None].to(ds.dtype))
    return (ds / temperature).to(h.dtype)


_EAGER = (_forward_chunk, _backward_chunk)
_COMPILED: dict[str, tuple] = {}  # per torch.compile backend


def _chunk_fns(compiled: bool) -> tuple:
    """The per-chunk math, eager or torch.compiled (``trainer.compile``). Compiled, the float32
    ``[chunk, V]`` intermediates (upcast, softmax, entropy, the gradient's elementwise algebra)
    are fused into a few kernels reading the matmul output once or twice, instead of ~10 full
    passes over ``chunk x V`` float32 in eager mode."""
    if not compiled:
        return _EAGER
    fns = _COMPILED.get(rc.BACKEND)
    if fns is None:
        fns = _COMPILED[rc.BACKEND] = (rc.compile_fn(_forward_chunk), rc.compile_fn(_backward_chunk))
    return fns


def _logits(h, weight, bias, out=None) -> torch.Tensor:
    """``h W^T + b`` in the compute dtype, optionally into ``out`` (a slice of the kept logits)."""
    if out is None:
        return F.linear(h, weight, bias)
    if bias is None:
        return torch.mm(h, weight.t(), out=out)
    return torch.addmm(bias, h, weight.t(), out=out)


class _ChunkedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature: float, chunk: int, compiled: bool, keep_bytes: int):
        T, V = hidden.shape[0], weight.shape[0]
        out_dtype = torch.promote_types(hidden.dtype, torch.float32)
        logp = hidden.new_empty(T, dtype=out_dtype)
        entropy = torch.empty_like(logp)
        lse = torch.empty_like(logp)
        kernels = lk.available(hidden) and out_dtype == torch.float32
        # the Triton path reads the logits in their compute dtype; keeping them (when they fit
        # the budget, and a backward will come) saves it one [T, H] x [H, V] matmul per micro-batch
        kept = None
        z_dtype = torch.promote_types(hidden.dtype, weight.dtype)
        if kernels and any(ctx.needs_input_grad[:3]) and T * V * z_dtype.itemsize <= keep_bytes:
            kept = hidden.new_empty(T, V, dtype=z_dtype)
        fwd = None if kernels else _chunk_fns(compiled)[0]
        for s in range(0, T, chunk):
            h, y = hidden[s : s + chunk], targets[s : s + chunk]
            if kernels:
                z = _logits(h, weight, bias, None if kept is None else kept[s : s + chunk])
                logp[s : s + chunk], entropy[s : s + chunk], lse[s : s + chunk] = lk.logprob_entropy(z, y, temperature)
            else:
                logp[s : s + chunk], entropy[s : s + chunk], lse[s : s + chunk] = fwd(h, weight, bias, y, temperature)
        ctx.save_for_backward(hidden, weight, bias, targets, lse, entropy, kept)
        ctx.temperature, ctx.chunk, ctx.compiled, ctx.kernels = temperature, chunk, compiled, kernels
        return logp, entropy

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        hidden, weight, bias, targets, lse, entropy, kept = ctx.saved_tensors
        tau, chunk = ctx.temperature, ctx.chunk
        bwd = None if ctx.kernels else _chunk_fns(ctx.compiled)[1]
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(hidden) if need_h else None
        # accumulate the weight gradient in float32 across chunks, cast once; on CUDA the bf16 /
        # fp16 GEMM adds into the float32 sum in its epilogue (no [V, H] product in the low
        # precision, cast and summed in separate passes)
        acc = torch.promote_types(weight.dtype, torch.float32)
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        fused_acc = weight.is_cuda and hidden.dtype in (torch.bfloat16, torch.float16) and acc == torch.float32
        grad_b = torch.zeros(weight.shape[0], dtype=acc, device=weight.device) if need_b else None
        g_logp, g_ent = g_logp.contiguous(), g_ent.contiguous()
        for s in range(0, hidden.shape[0], chunk):
            h, y, g, e = hidden[s : s + chunk], targets[s : s + chunk], g_logp[s : s + chunk], g_ent[s : s + chunk]
            if ctx.kernels:
                z = kept[s : s + chunk] if kept is not None else _logits(h, weight, bias)
                dz = lk.logprob_entropy_grad_(z, y, lse[s : s + chunk], entropy[s : s + chunk], g, e, tau)
            else:
                dz = bwd(h, weight, bias, y, lse[s : s + chunk], entropy[s : s + chunk], g, e, tau)
            if need_h:
                torch.mm(dz, weight, out=grad_h[s : s + chunk])
            if need_w and fused_acc:
                torch.addmm(grad_w, dz.t(), h, out_dtype=acc, out=grad_w)
            elif need_w:
                grad_w += (dz.t() @ h).to(acc)
            if need_b:
                grad_b += dz.to(acc).sum(0)
        return (
            grad_h,
            grad_w.to(weight.dtype) if need_w else None,
            grad_b.to(bias.dtype) if need_b else None,
            None,
            None,
            None,
            None,
            None,
        )


def chunked_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    chunk_tokens: int,
    bias: torch.Tensor | None = None,
    compiled: bool = False,
    keep_logits_bytes: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logp, entropy)`` float32 [T] for ``hidden`` [T, H]; never holds more than
    ``chunk_tokens x V`` float32 logits. ``chunk_tokens <= 0`` computes all positions at once.

    On CUDA (or Triton's interpreter) the per-chunk math runs in `logprob_kernels` (one pass over
    the compute-dtype logits); ``keep_logits_bytes``: keep those ``[T, V]`` logits for backward
    when they take at most this many bytes, instead of recomputing each chunk's matmul there.
    Elsewhere ``compiled`` runs the per-chunk math through torch.compile (same results up to
    rounding)."""
    chunk = chunk_tokens if chunk_tokens > 0 else max(hidden.shape[0], 1)
    return _ChunkedLogprobs.apply(
        hidden, weight, bias, targets, float(temperature), chunk, bool(compiled), int(keep_logits_bytes)
    )


class LogprobHead(nn.Module):
    """Replacement for ``lm_head``: holds the *same* weight parameter (so names, tying and
    FSDP2 sharding are unchanged) and, inside `logprob_request`, returns ``[..., 2]`` =
    (target logprob, entropy) instead of ``[..., V]`` logits.

    ``chunk_tokens == 0`` uses the plain full-logits computation (for comparison)."""

    def __init__(self, lm_head: nn.Linear, chunk_tokens: int):
        super().__init__()
        self.weight = lm_head.weight
        self.bias = lm_head.bias
        self.in_features, self.out_features = lm_head.in_features, lm_head.out_features
        self.chunk_tokens = chunk_tokens
        self.compiled = False  # trainer.compile: torch.compile the per-chunk math
        self.keep_logits_bytes = 0  # trainer.logprob_keep_logits_gib
        self.request: tuple[torch.Tensor, float, torch.Tensor | None] | None = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.request is None:
            return F.linear(hidden, self.weight, self.bias)
        targets, temperature, extra = self.request
        flat = hidden.reshape(-1, hidden.shape[-1])
        if self.chunk_tokens > 0:
            logp, ent = chunked_logprobs(
                flat,
                self.weight,
                targets,
                temperature,
                self.chunk_tokens,
                self.bias,
                compiled=self.compiled,
                keep_logits_bytes=self.keep_logits_bytes,
            )
        else:
            logp, ent = plain_logprobs(F.linear(flat, self.weight, self.bias), targets, temperature)
        columns = [logp[:, None], ent[:, None]]
        if extra is not None:
            columns.append(other_logprobs(flat, self.weight, self.bias, targets, logp, extra, temperature))
        return torch.cat(columns, dim=-1).view(*hidden.shape[:-1], -1)


def other_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    logp: torch.Tensor,
    others: torch.Tensor,
    temperature: float,
) -> torch.Tensor:
    """Logprobs [T, k] of the tokens `others` [T, k] at each position, from the targets' logprobs
    `logp` [T] (which carry the log-normaliser and its gradient)::

        log pi(j) = log pi(target) + (z_j - z_target) / temperature,   z = hidden . W (+ b)

    so no [T, V] logits are formed: only the k + 1 rows of W each position needs ([T, k, H])."""
    h = hidden.float()
    z_other = torch.einsum("th,tkh->tk", h, weight[others].float())
    z_target = (h * weight[targets].float()).sum(-1, keepdim=True)
    if bias is not None:
        z_other = z_other + bias[others].float()
        z_target = z_target + bias[targets].float()[:, None]
    return logp.float()[:, None] + (z_other - z_target) / temperature


def install_logprob_head(model: nn.Module, chunk_tokens: int) -> LogprobHead:
    head = model.lm_head
    if not isinstance(head, LogprobHead):
        head = LogprobHead(head, chunk_tokens)
        model.lm_head = head
    head.chunk_tokens = chunk_tokens
    return head


@contextlib.contextmanager
def logprob_request(
    model: nn.Module, targets: torch.Tensor, temperature: float, others: torch.Tensor | None = None
) -> Iterator[None]:
    """Within this block ``model(...).logits[..., 0]`` is the logprob of ``targets`` (flattened
    over batch and time), ``[..., 1]`` the entropy and, with ``others`` (long [T, k]),
    ``[..., 2:]`` the logprobs of those k tokens at each position (:func:`other_logprobs`)."""
    head = model.lm_head
    if not isinstance(head, LogprobHead):
        raise TypeError("model.lm_head is not a LogprobHead; call install_logprob_head first")
    head.request = (targets, temperature, others)
    try:
        yield
    finally:
        head.request = None
