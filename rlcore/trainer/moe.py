"""Expert-parallel MoE block for Qwen3-MoE-shaped models, and router statistics.

A transformers ``Qwen3MoeSparseMoeBlock`` (router ``gate.weight`` [E, H]; experts
``experts.gate_up_proj`` [E, 2I, H] and ``experts.down_proj`` [E, H, I]) is replaced by `MoEBlock`
with the same parameter names. With ``ep`` ranks in an expert-parallel group, rank ``r`` keeps
experts ``[r * E/ep, (r + 1) * E/ep)`` only.

Forward for ``N`` tokens ``x`` [N, H], top-k routing ``(w, e)`` [N, k]::

    y_n = sum_{i<k} w_ni * Expert_{e_ni}(x_n),   Expert(x) = W_down (silu(W_gate x) * W_up x)

Dispatch: the ``N k`` (token, slot) pairs are sorted by expert, so the rows for the experts of ep
rank ``r`` are one contiguous block; per-expert counts are exchanged with an all-to-all, rows with
a differentiable all-to-all (``all_to_all_single_autograd``: its backward is the reverse
all-to-all). The owner regroups received rows by local expert, applies them, and the reverse
all-to-all brings results back to the sending rank, which un-sorts and combines with ``w``.
No capacity factor: no token is dropped, so the result equals the single-rank block exactly
(up to summation order).

Routing replay (`rlcore.batch.routing`): with ``replay`` set (`set_routing`: int [N, k] per block, -1
for a token that routes itself), a token's experts are the given ``g_n`` instead of its own top-k,
and its weights are still the trainer's router probabilities gathered there::

    p_n = softmax(router_logits_n),   w_ni = p_n[g_ni] / sum_j p_n[g_nj]  (norm_topk_prob; else p_n[g_ni])

so the router keeps its gradient. The metric ``moe_replay_agreement`` is the fraction of replayed
(token, layer, slot) whose given expert is also in the trainer's own top-k.

Router statistics (per layer, over the tokens of a step, summed over all ranks):
tokens per expert ``c_e``, load imbalance ``max_e c_e / mean_e c_e`` (1 = balanced), and mean
router entropy ``-sum_e p_e log p_e`` (nats).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import _functional_collectives as fc

from rlcore.models.vision import decoder_layers


def grouped_mm_available() -> bool:
    return hasattr(torch, "_grouped_mm")


class LocalExperts(nn.Module):
    """The experts this rank owns, stored like transformers' fused ``Qwen3MoeExperts``.

    Two ways to apply them to rows grouped by expert (same result up to summation order):

    - grouped: two ``torch._grouped_mm`` calls (one for ``gate_up``, one for ``down``) over all
      local experts, group boundaries ``offs = cumsum(counts)`` (int32, on device: no host sync).
      Weights are passed as ``W.transpose(-2, -1)`` (``[E, in, out]`` views, column-major per
      expert: the layout the Hopper kernel takes without a copy). Needs bf16 operands whose row
      strides are multiples of 16 bytes (hidden and intermediate sizes multiples of 8);
      empty groups are fine. Used on CUDA in bf16 (``grouped=None``, the default).
    - loop: one pair of matmuls per local expert (``counts`` on the host): the CPU / fp32
      fallback and the reference the grouped path is tested against.
    """

    def __init__(self, experts: nn.Module, ep_rank: int, ep_size: int, ep_group: dist.ProcessGroup | None):
        super().__init__()
        E = experts.num_experts
        n = E // ep_size
        sl = slice(ep_rank * n, (ep_rank + 1) * n)
        self.gate_up_proj = nn.Parameter(experts.gate_up_proj.data[sl].clone())
        self.down_proj = nn.Parameter(experts.down_proj.data[sl].clone())
        self.act_fn = experts.act_fn
        self.num_experts, self.num_local, self.first = E, n, ep_rank * n
        self.ep_size, self.ep_group = ep_size, ep_group
        self.grouped: bool | None = None  # None: grouped on CUDA in bf16, else the loop

    def use_grouped(self, x: torch.Tensor) -> bool:
        if self.grouped is not None:
            return self.grouped
        return x.is_cuda and x.dtype == torch.bfloat16 and grouped_mm_available()

    def forward(self, x: torch.Tensor, counts: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        """``x`` rows grouped by local expert (``counts[i]`` rows for local expert ``i``; an
        integer tensor of ``num_local`` entries). ``scale`` [rows] (optional): a factor per row
        applied before the down projection, ``W_down (s * h) = s * W_down h``: the routing weight
        on the intermediate width instead of the hidden one."""
        if self.use_grouped(x):
            offs = torch.cumsum(counts, 0, dtype=torch.int32)
            w_gu = self.gate_up_proj.to(x.dtype).transpose(-2, -1)  # [n, H, 2I]
            w_d = self.down_proj.to(x.dtype).transpose(-2, -1)  # [n, I, H]
            gate, up = torch._grouped_mm(x, w_gu, offs=offs).chunk(2, dim=-1)
            h = self.act_fn(gate) * up
            return torch._grouped_mm(h if scale is None else h * scale[:, None], w_d, offs=offs)
        outs = []
        sizes = counts.tolist()
        scales = scale.split(sizes) if scale is not None else [None] * len(sizes)
        for i, (rows, s) in enumerate(zip(x.split(sizes), scales)):
            gate, up = F.linear(rows, self.gate_up_proj[i]).chunk(2, dim=-1)
            h = self.act_fn(gate) * up
            outs.append(F.linear(h if s is None else h * s[:, None], self.down_proj[i]))
        return torch.cat(outs) if outs else x[:0]


class MoEBlock(nn.Module):
    """Drop-in for ``Qwen3MoeSparseMoeBlock`` with expert parallelism over ``ep_group``."""

    def __init__(self, block: nn.Module, ep_group: dist.ProcessGroup | None):
        super().__init__()
        ep_size = dist.get_world_size(ep_group) if ep_group is not None else 1
        ep_rank = dist.get_rank(ep_group) if ep_group is not None else 0
        self.gate = block.gate
        self.experts = LocalExperts(block.experts, ep_rank, ep_size, ep_group)
        self.top_k = block.gate.top_k
        self.num_experts = block.experts.num_experts
        self.norm_topk_prob = bool(getattr(block.gate, "norm_topk_prob", True))
        self.layer_index = 0  # position among the decoder layers (set by apply_expert_parallel)
        self.replay: torch.Tensor | None = None  # [N, k] experts to use (-1: own top-k); set_routing
        self.reset_stats()

    def reset_stats(self) -> None:
        self.stat_counts: torch.Tensor | None = None
        self.stat_entropy: torch.Tensor | None = None  # on device: no host sync per forward
        self.stat_tokens = 0
        self.stat_agree: torch.Tensor | None = None  # replayed slots also in the own top-k
        self.stat_replayed: torch.Tensor | None = None  # replayed slots

    @torch._dynamo.disable  # host-side bookkeeping: runs eagerly under trainer.compile
    def _record(self, logits: torch.Tensor, counts: torch.Tensor) -> None:
        if not self._counting():
            return
        with torch.no_grad():
            logp = torch.log_softmax(logits.float(), dim=-1)
            ent = -(logp.exp() * logp).sum()
        c = counts.detach().float()
        self.stat_counts = c if self.stat_counts is None else self.stat_counts + c
        self.stat_entropy = ent if self.stat_entropy is None else self.stat_entropy + ent
        self.stat_tokens += logits.shape[0]

    @staticmethod
    def _counting() -> bool:
        """Statistics count real forwards of the trained policy only: not no-grad passes (reference
        model) and not the recomputation of a checkpointed layer inside backward."""
        return torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1

    def _replayed(self, logits: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor):
        """(weights, experts) [N, k] with the replayed rows' experts and their renormalised router
        probabilities (module docstring); rows holding -1 keep the router's own top-k."""
        r = self.replay
        if r.shape != experts.shape:
            raise ValueError(f"routing replay: layer {self.layer_index} got experts of shape {tuple(r.shape)}, "
                             f"the block routes {tuple(experts.shape)} (tokens, top_k)")
        given = r.to(device=experts.device, dtype=experts.dtype)
        own = (given < 0).any(-1, keepdim=True)  # [N, 1]
        given = torch.where(own, experts, given)
        w = torch.softmax(logits, dim=-1, dtype=torch.float).gather(-1, given)
        if self.norm_topk_prob:
            w = w / w.sum(-1, keepdim=True)
        w = torch.where(own, weights, w.to(weights.dtype))
        if self._counting():
            with torch.no_grad():
                hit = (given[:, :, None] == experts[:, None, :]).any(-1) & ~own
                agree, n = hit.sum(), (~own).sum() * given.shape[-1]
            self.stat_agree = agree if self.stat_agree is None else self.stat_agree + agree
            self.stat_replayed = n if self.stat_replayed is None else self.stat_replayed + n
        return w, given

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        logits, weights, experts = self.gate(x)  # [N, E], [N, k], [N, k]
        if self.replay is not None:
            weights, experts = self._replayed(logits, weights, experts)
        k = experts.shape[-1]
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)
        # tokens per expert (a fixed-size scatter, unlike bincount's data-dependent size)
        counts = torch.zeros(self.num_experts, dtype=torch.int64, device=flat.device).scatter_add_(
            0, flat, torch.ones_like(flat))
        self._record(logits, counts)
        routed = x[order // k]  # (token, slot) rows sorted by expert
        ex = self.experts
        if ex.ep_size == 1:  # the routing weights scale the I-wide intermediate rows (I < H)
            out_sorted = ex(routed, counts, weights.reshape(-1)[order].to(x.dtype))
        else:
            out_sorted = self._dispatch(routed, counts)
        out = torch.empty_like(out_sorted)
        out[order] = out_sorted  # back to (token, slot) order; index_put is differentiable
        if ex.ep_size == 1:
            y = out.view(-1, k, shape[-1]).sum(1)
        else:
            y = (out.view(-1, k, shape[-1]) * weights.to(out.dtype)[..., None]).sum(1)
        return y.view(shape)

    def _dispatch(self, routed: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        ex = self.experts
        ep, n = ex.ep_size, ex.num_local
        # recv[s, i] = rows rank s sends to my local expert i
        recv = _exchange(counts, ex.ep_group).view(ep, n)
        send_splits = counts.view(ep, n).sum(1).tolist()
        recv_splits = recv.sum(1).tolist()
        got = fc.all_to_all_single_autograd(routed, recv_splits, send_splits, ex.ep_group)
        # rows arrive ordered (source rank, local expert): regroup by local expert
        expert_of_row = torch.arange(n, device=routed.device).repeat(ep).repeat_interleave(recv.flatten())
        perm = torch.argsort(expert_of_row, stable=True)
        y = ex(got[perm], recv.sum(0))
        back = torch.empty_like(y)
        back[perm] = y
        return fc.all_to_all_single_autograd(back, send_splits, recv_splits, ex.ep_group)


def _exchange(counts: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Non-differentiable all-to-all of the per-expert counts (equal splits of ``E / ep``)."""
    out = torch.empty_like(counts)
    dist.all_to_all_single(out, counts, group=group)
    return out


def _is_qwen3_moe_block(m: nn.Module) -> bool:
    experts = getattr(m, "experts", None)
    return (hasattr(m, "gate") and experts is not None and hasattr(experts, "gate_up_proj")
            and hasattr(experts, "down_proj") and hasattr(m.gate, "top_k"))


def apply_expert_parallel(model: nn.Module, ep_group: dist.ProcessGroup | None) -> list[MoEBlock]:
    """Replace every Qwen3-MoE sparse block by a `MoEBlock` (also with ep = 1, for the router
    statistics and sorted dispatch). Returns the blocks."""
    blocks = []
    for i, layer in enumerate(decoder_layers(model)):
        mlp = getattr(layer, "mlp", None)
        if isinstance(mlp, MoEBlock):
            blocks.append(mlp)
        elif mlp is not None and _is_qwen3_moe_block(mlp):
            layer.mlp = MoEBlock(mlp, ep_group)
            layer.mlp.layer_index = i
            blocks.append(layer.mlp)
    if ep_group is not None and dist.get_world_size(ep_group) > 1 and not blocks:
        raise ValueError("trainer.ep > 1 but the model has no Qwen3-MoE-shaped sparse blocks")
    return blocks


def set_routing(model: nn.Module, routed: torch.Tensor | None) -> None:
    """Make every `MoEBlock` of `model` replay `routed` (int [N, layers, top_k] over the tokens the
    blocks will see, -1 = own top-k; `rlcore.batch.routing`) in its next forwards, or route itself
    (None). It stays set until the next call, so the recomputation of a checkpointed layer in
    backward routes like its forward did."""
    blocks = [m for m in model.modules() if isinstance(m, MoEBlock)]
    if routed is not None and not blocks:
        raise ValueError("routing replay: the micro-batch carries routed experts but the policy has no MoE blocks")
    for b in blocks:
        if routed is None:
            b.replay = None
            continue
        if routed.shape[1] <= b.layer_index or routed.shape[2] != b.top_k:
            raise ValueError(f"routing replay: routed experts of shape {tuple(routed.shape)} do not fit layer "
                             f"{b.layer_index} (top_k {b.top_k}) of the policy")
        b.replay = routed[:, b.layer_index]


def expert_modules(model: nn.Module) -> dict[str, LocalExperts]:
    """Qualified module name -> `LocalExperts`."""
    return {name: m for name, m in model.named_modules() if isinstance(m, LocalExperts)}


def router_metrics(model: nn.Module, group: dist.ProcessGroup | None = None) -> dict[str, float]:
    """Step router statistics summed over ``group`` (collective when there are MoE blocks on any
    rank: call on all ranks). Resets the accumulators."""
    blocks = [m for m in model.modules() if isinstance(m, MoEBlock)]
    if not blocks:
        return {}
    E = blocks[0].num_experts
    w = blocks[0].gate.weight
    dev = w.to_local().device if hasattr(w, "to_local") else w.device  # DTensor once FSDP-sharded
    rows = []
    for b in blocks:
        c = b.stat_counts if b.stat_counts is not None else torch.zeros(E, device=dev)
        ent = b.stat_entropy if b.stat_entropy is not None else torch.zeros((), device=dev)
        replay = [torch.zeros((), device=dev) if v is None else v.to(dev).float()
                  for v in (b.stat_agree, b.stat_replayed)]
        rows.append(torch.cat([c.to(dev).float(), ent.to(dev).float().reshape(1),
                               torch.tensor([float(b.stat_tokens)], device=dev), *(v.reshape(1) for v in replay)]))
        b.reset_stats()
    t = torch.stack(rows).double()
    if dist.is_initialized():
        dist.all_reduce(t, group=group)
    counts, ent, tokens = t[:, :E], t[:, E], t[:, E + 1]
    agree, replayed = float(t[:, E + 2].sum()), float(t[:, E + 3].sum())
    if float(tokens.sum()) == 0:
        return {}
    imbalance = counts.max(1).values / counts.mean(1).clamp_min(1e-9)
    out = {"moe_load_imbalance": float(imbalance.mean()), "moe_load_imbalance_max": float(imbalance.max()),
           "moe_router_entropy": float(ent.sum() / tokens.sum()),
           "moe_dead_expert_frac": float((counts == 0).double().mean())}
    if replayed > 0:
        out["moe_replay_agreement"] = agree / replayed
    return out
