"""One expert-parallel MoE layer for every routed-expert family, and router statistics.

A transformers MoE block (Qwen2/3-MoE, Qwen3-Next, Mixtral, gpt-oss, DeepSeek-V3, GLM-4.5; the
family adapters of `rlcore.models.moe_family`) is replaced by `MoEBlock`, which keeps the block's
router, experts and shared experts under their own attribute names, so every parameter keeps its
transformers name. With ``ep`` ranks in an expert-parallel group, rank ``r`` keeps experts
``[r * E/ep, (r + 1) * E/ep)`` only (`rlcore.trainer.moe_experts.LocalExperts`).

Forward for ``N`` tokens ``x`` [N, H], top-k routing ``(w, e)`` [N, k] from the family's own
router module (its logits, its top-k: softmax, biased top-k-then-softmax, or sigmoid scores with
a correction bias and group-limited top-k)::

    y_n = sum_{i<k} w_ni * Expert_{e_ni}(x_n)  [+ Shared(x_n), times sigmoid(g x_n) when gated]

Dispatch: the ``N k`` (token, slot) pairs are sorted by expert once (one ``argsort``), and the
token rows gathered once in that order; the rows for the experts of ep rank ``r`` are one
contiguous block. Per-expert counts are exchanged with an all-to-all, rows with a
differentiable all-to-all (``all_to_all_single_autograd``: its backward is the reverse
all-to-all). The owner regroups received rows by local expert, applies them, and the reverse
all-to-all brings results back; the sender scales each row by its weight and sums each token's
``k`` rows. Every row movement, forward and backward, is a gather by the sort or its inverse
(`rlcore.trainer.moe_kernels`: no atomics, the same sums on every run). No capacity factor: no
token is dropped, so the result equals the single-rank block exactly (up to summation order).

Routing replay (`rlcore.batch.routing`): with ``replay`` set (`set_routing`: int [N, k] per block, -1
for a token that routes itself), a token's experts are the given ``g_n`` instead of its own top-k,
and its weights are what the family's router gives those experts from the trainer's own logits
(`rlcore.trainer.moe_experts.weights_at`, e.g. ``p_n[g_ni] / sum_j p_n[g_nj]`` for softmax top-k),
so the router keeps its gradient. The metric ``moe_replay_agreement`` is the fraction of replayed
(token, layer, slot) whose given expert is also in the trainer's own top-k.

Router statistics (per layer, over the tokens of a step, summed over all ranks):
tokens per expert ``c_e``, load imbalance ``max_e c_e / mean_e c_e`` (1 = balanced), and mean
router entropy ``-sum_e p_e log p_e`` (nats; for sigmoid scoring, of the normalised scores).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import _functional_collectives as fc

from rlcore.models.moe_family import block_parts, is_moe_block, router_kind
from rlcore.models.vision import decoder_layers, text_config
from rlcore.trainer.moe_experts import LocalExperts, routing_distribution, weights_at
from rlcore.trainer.moe_kernels import gather_rows, inverse_permutation, permute, sum_rows


class MoEBlock(nn.Module):
    """Drop-in for a transformers MoE block (any family of `rlcore.models.moe_family`) with
    expert parallelism over ``ep_group``, router statistics and routing replay."""

    def __init__(self, block: nn.Module, ep_group: dist.ProcessGroup | None, family: str = "moe"):
        super().__init__()
        ep_size = dist.get_world_size(ep_group) if ep_group is not None else 1
        ep_rank = dist.get_rank(ep_group) if ep_group is not None else 0
        parts = block_parts(block, family)
        self.family = family
        self.router_name = parts["router"]
        router = getattr(block, self.router_name)
        setattr(self, self.router_name, router)  # same attribute: same parameter names
        self.experts = LocalExperts(block.experts, ep_rank, ep_size, ep_group)
        self.shared_name = parts.get("shared_experts")
        if self.shared_name:
            setattr(self, self.shared_name, getattr(block, self.shared_name))
        if "shared_gate" in parts:
            self.shared_expert_gate = block.shared_expert_gate
        self.kind = router_kind(router)
        self.top_k = router.top_k
        self.num_experts = block.experts.num_experts
        self.norm_topk_prob = bool(getattr(router, "norm_topk_prob", True))  # Mixtral: always
        self.jitter = float(getattr(block, "jitter_noise", 0.0) or 0.0)  # Mixtral's training-time input noise
        self.returns_scores = self.kind == "topk_softmax"  # gpt-oss's MLP returns (out, router scores)
        self.layer_index = 0  # position among the decoder layers (set by apply_expert_parallel)
        self.replay: torch.Tensor | None = None  # [N, k] experts to use (-1: own top-k); set_routing
        self.reset_stats()

    def route_module(self) -> nn.Module:
        return getattr(self, self.router_name)

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
            logp = routing_distribution(self.kind, logits)
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
        """(weights, experts) [N, k] with the replayed rows' experts and the weights the family's
        router gives them (module docstring); rows holding -1 keep the router's own top-k."""
        r = self.replay
        if r.shape != experts.shape:
            raise ValueError(
                f"routing replay: layer {self.layer_index} got experts of shape {tuple(r.shape)}, "
                f"the block routes {tuple(experts.shape)} (tokens, top_k)"
            )
        given = r.to(device=experts.device, dtype=experts.dtype)
        own = (given < 0).any(-1, keepdim=True)  # [N, 1]
        given = torch.where(own, experts, given)
        w = weights_at(self.kind, self.route_module(), logits, given, self.norm_topk_prob)
        w = torch.where(own, weights.float(), w)
        if self._counting():
            with torch.no_grad():
                hit = (given[:, :, None] == experts[:, None, :]).any(-1) & ~own
                agree, n = hit.sum(), (~own).sum() * given.shape[-1]
            self.stat_agree = agree if self.stat_agree is None else self.stat_agree + agree
            self.stat_replayed = n if self.stat_replayed is None else self.stat_replayed + n
        return w, given

    def forward(self, hidden_states: torch.Tensor):
        shape = hidden_states.shape
        if self.training and self.jitter > 0:
            hidden_states = hidden_states * torch.empty_like(hidden_states).uniform_(
                1.0 - self.jitter, 1.0 + self.jitter
            )
        x = hidden_states.reshape(-1, shape[-1])
        logits, weights, experts = self.route_module()(x)  # [N, E], [N, k], [N, k]: the family's own routing
        if self.replay is not None:
            weights, experts = self._replayed(logits, weights, experts)
        k = experts.shape[-1]
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (token, slot) rows sorted by expert: the one permutation
        token, inverse = order // k, inverse_permutation(order)
        # tokens per expert (a fixed-size scatter, unlike bincount's data-dependent size)
        counts = torch.zeros(self.num_experts, dtype=torch.int64, device=flat.device).scatter_add_(
            0, flat, torch.ones_like(flat)
        )
        self._record(logits, counts)
        ex = self.experts
        routed = gather_rows(x, token, inverse, k, ex.kernels)
        w_sorted = weights.reshape(-1).index_select(0, order).to(x.dtype)
        if ex.ep_size == 1:  # the routing weights scale the I-wide intermediate rows (I < H)
            rows = ex(routed, counts, w_sorted)
        else:
            rows = self._dispatch(routed, counts) * w_sorted[:, None]
        y = sum_rows(rows.to(x.dtype), token, inverse, k, ex.kernels)  # back to tokens: each token's k rows summed
        if self.shared_name:
            shared = getattr(self, self.shared_name)(x)
            if hasattr(self, "shared_expert_gate"):
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            y = y + shared
        y = y.view(shape)
        return (y, weights) if self.returns_scores else y

    def _dispatch(self, routed: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        ex = self.experts
        ep, n = ex.ep_size, ex.num_local
        # recv[s, i] = rows rank s sends to my local expert i
        recv = _exchange(counts, ex.ep_group).view(ep, n)
        splits = torch.cat([counts.view(ep, n).sum(1), recv.sum(1)]).tolist()  # one host sync, not two
        send_splits, recv_splits = splits[:ep], splits[ep:]
        got = fc.all_to_all_single_autograd(routed, recv_splits, send_splits, ex.ep_group)
        # rows arrive ordered (source rank, local expert): regroup by local expert and back
        expert_of_row = torch.arange(n, device=routed.device).repeat(ep).repeat_interleave(recv.flatten())
        perm = torch.argsort(expert_of_row, stable=True)
        inverse = inverse_permutation(perm)
        y = ex(permute(got, perm, inverse), recv.sum(0))
        return fc.all_to_all_single_autograd(permute(y, inverse, perm), send_splits, recv_splits, ex.ep_group)


def _exchange(counts: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Non-differentiable all-to-all of the per-expert counts (equal splits of ``E / ep``)."""
    out = torch.empty_like(counts)
    dist.all_to_all_single(out, counts, group=group)
    return out


def model_family(model: nn.Module) -> str:
    """The model type of a transformers model's language model (``config.model_type``)."""
    return str(getattr(text_config(model.config), "model_type", type(model).__name__))


def apply_expert_parallel(model: nn.Module, ep_group: dist.ProcessGroup | None) -> list[MoEBlock]:
    """Replace every routed-expert block (`rlcore.models.moe_family.is_moe_block`) by a
    `MoEBlock` (also with ep = 1, for the router statistics, replay and the sorted dispatch).
    Dense layers (a family's dense first layers) stay as they are. Returns the blocks; raises
    ValueError naming the family when a block has parts rlcore does not compute, or when
    ep > 1 and the model has no such block."""
    family = model_family(model)
    blocks = []
    for i, layer in enumerate(decoder_layers(model)):
        mlp = getattr(layer, "mlp", None)
        if isinstance(mlp, MoEBlock):
            blocks.append(mlp)
        elif mlp is not None and is_moe_block(mlp):
            layer.mlp = MoEBlock(mlp, ep_group, family)
            layer.mlp.layer_index = i
            blocks.append(layer.mlp)
    if ep_group is not None and dist.get_world_size(ep_group) > 1 and not blocks:
        raise ValueError(
            f"trainer.ep > 1 but the {family} model has no routed-expert blocks rlcore can shard "
            "(a router with top_k and fused 3-D experts under layers[i].mlp)"
        )
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
            raise ValueError(
                f"routing replay: routed experts of shape {tuple(routed.shape)} do not fit layer "
                f"{b.layer_index} (top_k {b.top_k}) of the policy"
            )
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
    w = blocks[0].route_module().weight
    dev = w.to_local().device if hasattr(w, "to_local") else w.device  # DTensor once FSDP-sharded
    rows = []
    for b in blocks:
        c = b.stat_counts if b.stat_counts is not None else torch.zeros(E, device=dev)
        ent = b.stat_entropy if b.stat_entropy is not None else torch.zeros((), device=dev)
        replay = [
            torch.zeros((), device=dev) if v is None else v.to(dev).float() for v in (b.stat_agree, b.stat_replayed)
        ]
        rows.append(
            torch.cat(
                [
                    c.to(dev).float(),
                    ent.to(dev).float().reshape(1),
                    torch.tensor([float(b.stat_tokens)], device=dev),
                    *(v.reshape(1) for v in replay),
                ]
            )
        )
        b.reset_stats()
    t = torch.stack(rows).double()
    if dist.is_initialized():
        dist.all_reduce(t, group=group)
    counts, ent, tokens = t[:, :E], t[:, E], t[:, E + 1]
    agree, replayed = float(t[:, E + 2].sum()), float(t[:, E + 3].sum())
    if float(tokens.sum()) == 0:
        return {}
    imbalance = counts.max(1).values / counts.mean(1).clamp_min(1e-9)
    out = {
        "moe_load_imbalance": float(imbalance.mean()),
        "moe_load_imbalance_max": float(imbalance.max()),
        "moe_router_entropy": float(ent.sum() / tokens.sum()),
        "moe_dead_expert_frac": float((counts == 0).double().mean()),
    }
    if replayed > 0:
        out["moe_replay_agreement"] = agree / replayed
    return out
