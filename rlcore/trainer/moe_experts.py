"""The routed experts one rank holds, applied to rows grouped by expert; and the routing weights
of each router kind (`rlcore.models.moe_family`).

Expert layouts (transformers' fused 3-D experts, kept under their own parameter names, sliced
over the experts this rank owns):

- ``rows`` (Qwen-MoE, Mixtral, DeepSeek-V3, GLM-4.5): ``gate_up_proj`` ``[E, 2I, H]`` (gate rows,
  then up rows), ``down_proj`` ``[E, H, I]``; ``Expert(x) = W_down (act(W_gate x) * W_up x)``;
- ``cols`` (gpt-oss): ``gate_up_proj`` ``[E, H, 2I]`` with gate and up interleaved in the
  columns, biases ``gate_up_proj_bias`` ``[E, 2I]`` and ``down_proj_bias`` ``[E, H]``, and the
  clamped SwiGLU ``(clamp(u, -L, L) + 1) * g' * sigmoid(alpha g')``, ``g' = min(g, L)``.

Two ways to apply them (same result up to summation order; tests hold them together):

- grouped: two ``torch._grouped_mm`` calls over all local experts, group ends
  ``offs = cumsum(counts)`` (int32, on device: no host sync, no Python loop over experts).
  Weights are passed as ``[E, in, out]`` views (a transpose of the ``rows`` layout; the ``cols``
  layout is already one). Default on CUDA in bf16 where the GPU has the kernel (compute
  capability >= 9.0); CPU runs it too when asked (``grouped=True``), for tests.
- loop: one pair of matmuls per local expert (``counts`` read on the host): the CPU / fp32
  default and the reference.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from rlcore.trainer.moe_kernels import EAGER, MoEKernels

EXPERT_LEAVES = ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias")
"""Expert parameters sliced over the ep ranks (those a layout has)."""


def grouped_mm_available(device: torch.device | None = None) -> bool:
    """Whether ``torch._grouped_mm`` runs fast on ``device``: a CUDA GPU of compute capability >= 9.0."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if device is None or device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(device) >= (9, 0)


class LocalExperts(nn.Module):
    """The experts ``[first, first + num_local)`` of a transformers fused experts module."""

    def __init__(self, experts: nn.Module, ep_rank: int, ep_size: int, ep_group: dist.ProcessGroup | None):
        super().__init__()
        E = experts.num_experts
        if E % ep_size:
            raise ValueError(f"expert parallelism: ep={ep_size} does not divide the {E} experts")
        n = E // ep_size
        sl = slice(ep_rank * n, (ep_rank + 1) * n)
        self.layout = "cols" if hasattr(experts, "gate_up_proj_bias") else "rows"
        for leaf in EXPERT_LEAVES:
            p = getattr(experts, leaf, None)
            if p is not None:
                setattr(self, leaf, nn.Parameter(p.data[sl].clone(), requires_grad=p.requires_grad))
        if self.layout == "cols":
            self.alpha, self.limit = float(experts.alpha), float(experts.limit)
        else:
            self.act_fn = experts.act_fn
        # SiLU (every rows-layout family so far) runs as one fusable function; another act as given
        self.silu = type(getattr(self, "act_fn", None)).__name__ in ("SiLU", "SiLUActivation")
        self.kernels: MoEKernels = EAGER  # `rlcore.trainer.moe_kernels.kernels(compiled=True)` under trainer.compile
        self.num_experts, self.num_local, self.first = E, n, ep_rank * n
        self.ep_size, self.ep_group = ep_size, ep_group
        self.grouped: bool | None = None  # None: grouped where `grouped_mm_available`, else the loop

    def leaves(self) -> tuple[str, ...]:
        """Names of this module's expert parameters (sharded over ep)."""
        return tuple(leaf for leaf in EXPERT_LEAVES if hasattr(self, leaf))

    def use_grouped(self, x: torch.Tensor) -> bool:
        if self.grouped is not None:
            return self.grouped
        return x.dtype == torch.bfloat16 and grouped_mm_available(x.device)

    def _glu(self, gu: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        """The layout's gated activation of ``gu`` times the rows' routing weights ``scale``."""
        if self.layout == "cols":
            return self.kernels.clamped_swiglu(gu, scale, self.alpha, self.limit)
        if self.silu:
            return self.kernels.swiglu(gu, scale)
        gate, up = gu.chunk(2, dim=-1)
        h = self.act_fn(gate) * up
        return h if scale is None else h * scale[:, None]

    def forward(self, x: torch.Tensor, counts: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        """``x`` rows grouped by local expert (``counts[i]`` rows for local expert ``i``; an
        integer tensor of ``num_local`` entries). ``scale`` [rows] (optional): the routing weight
        of each row, applied before the down projection (``W (s h) + s b = s (W h + b)``: on the
        I-wide intermediate instead of the H-wide output)."""
        bias = getattr(self, "gate_up_proj_bias", None)
        if self.use_grouped(x):
            offs = torch.cumsum(counts, 0, dtype=torch.int32)
            w_gu, w_d = self.gate_up_proj.to(x.dtype), self.down_proj.to(x.dtype)
            if self.layout == "rows":  # [n, 2I, H] -> [n, H, 2I] views (column-major per expert)
                w_gu, w_d = w_gu.transpose(-2, -1), w_d.transpose(-2, -1)
            gu = torch._grouped_mm(x, w_gu, offs=offs)
            eid = None
            if bias is not None:  # expert of each row, without a host sync (the row count is known)
                eid = torch.repeat_interleave(
                    torch.arange(self.num_local, device=x.device), counts, output_size=x.shape[0]
                )
                gu = gu + self.gate_up_proj_bias.to(x.dtype).index_select(0, eid)
            out = torch._grouped_mm(self._glu(gu, scale), w_d, offs=offs)
            if eid is not None:
                b = self.down_proj_bias.to(x.dtype).index_select(0, eid)
                out = out + (b if scale is None else b * scale[:, None])
            return out
        outs = []
        sizes = counts.tolist()
        scales = scale.split(sizes) if scale is not None else [None] * len(sizes)
        for i, (rows, s) in enumerate(zip(x.split(sizes), scales)):
            if self.layout == "rows":
                out = F.linear(self._glu(F.linear(rows, self.gate_up_proj[i]), s), self.down_proj[i])
            else:
                h = self._glu(rows @ self.gate_up_proj[i] + self.gate_up_proj_bias[i], s)
                b = self.down_proj_bias[i]
                out = h @ self.down_proj[i] + (b if s is None else s[:, None] * b)
            outs.append(out)
        return torch.cat(outs) if outs else x.new_zeros((0, x.shape[-1]))


def weights_at(
    kind: str, router: nn.Module, logits: torch.Tensor, experts: torch.Tensor, norm_topk_prob: bool
) -> torch.Tensor:
    """The routing weights [N, k] (float32) a router of `kind` gives the experts `experts` [N, k]
    from its logits [N, E] (`rlcore.models.moe_family`): what the router's own forward computes
    for its own top-k, here for any given experts (routing replay), differentiable in `logits`."""
    if kind == "topk_softmax":
        return torch.softmax(logits.float().gather(-1, experts), dim=-1)
    if kind == "sigmoid_group":
        w = torch.sigmoid(logits.float()).gather(-1, experts)
        if norm_topk_prob:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return w * float(router.routed_scaling_factor)
    w = torch.softmax(logits, dim=-1, dtype=torch.float).gather(-1, experts)
    return w / w.sum(-1, keepdim=True) if norm_topk_prob else w


def routing_distribution(kind: str, logits: torch.Tensor) -> torch.Tensor:
    """log p [N, E] of the distribution a router spreads over its experts, for the entropy
    statistic: ``softmax(l)``; for sigmoid scoring, the scores normalised to sum 1."""
    if kind == "sigmoid_group":
        logs = F.logsigmoid(logits.float())
        return logs - torch.logsumexp(logs, dim=-1, keepdim=True)
    return torch.log_softmax(logits.float(), dim=-1)
