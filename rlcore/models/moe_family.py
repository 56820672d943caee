"""Mixture-of-experts families: what rlcore knows about each routed-expert model type.

One small adapter per family, used on both sides of the house:

- **before Ray starts** (`rlcore.plan`, `rlcore.batch.routing`): which config key holds the
  routed-expert count (``num_experts``, ``n_routed_experts``, ``num_local_experts``), the top-k key,
  and whether rlcore can shard the family at all (:func:`moe_arch`, :func:`moe_problem`);
- **on a built model** (`rlcore.trainer.moe`, the transformers engine's router hooks): where a
  decoder layer's MoE block keeps its router, routed experts and shared experts
  (:func:`block_parts`). The block is recognised by its structure (a router with ``top_k`` and a
  ``[E, H]`` weight, fused 3-D experts), and every child the adapter does not know makes it
  refused by name, so a family with a part rlcore would silently drop never trains wrong.

Router kinds (``MoEFamily.router``), for ``N`` tokens with router logits ``l`` ``[N, E]``:

- ``softmax_topk`` (Qwen2/3-MoE, Qwen3-Next, Mixtral): ``p = softmax(l)``, experts = top-k of
  ``p``, weights ``p[e]`` (renormalised over the k when ``norm_topk_prob``; Mixtral always);
- ``topk_softmax`` (gpt-oss; ``l`` includes the router bias): experts = top-k of ``l``, weights
  ``softmax(l[e])`` over the k;
- ``sigmoid_group`` (DeepSeek-V3, GLM-4.5): ``s = sigmoid(l)``; choice by ``s + b`` (the
  ``e_score_correction_bias``) within the ``topk_group`` best of ``n_group`` expert groups (a
  group scores the sum of its two best); weights ``s[e]`` (renormalised when ``norm_topk_prob``)
  times ``routed_scaling_factor``.

Torch-free (modules are only read through attributes), so the planner imports it cheaply.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

RouterKind = Literal["softmax_topk", "topk_softmax", "sigmoid_group"]
EXPERT_COUNT_KEYS = ("num_experts", "n_routed_experts", "num_local_experts")
"""Config keys that hold a routed-expert count, in the order rlcore reads them."""


@dataclass(frozen=True)
class MoEFamily:
    """What rlcore needs to know of one routed-expert family."""

    name: str
    experts_key: str  # config key of the routed-expert count
    router: RouterKind
    dense_layers: str = ""  # how the family keeps some layers dense (for the README / messages)
    top_k_key: str = "num_experts_per_tok"
    shared: str = ""  # shared experts: "" none, "added" (DeepSeek), "gated" (Qwen2-MoE: sigmoid gate)
    expert_bias: bool = False  # per-expert biases on both projections (gpt-oss)
    note: str = ""  # a limit of the family in rlcore (README)
    # vLLM 0.26's model for the family loads routed experts through FusedMoE's loader, which takes
    # a whole fused tensor (`rlcore.models.checkpoint_names`); else (DeepSeek-V3: a hand-written
    # per-expert loader) weight sync sends the checkpoint's per-expert tensors
    vllm_fused_experts: bool = True


FAMILIES: dict[str, MoEFamily] = {
    f.name: f
    for f in (
        MoEFamily("qwen3_moe", "num_experts", "softmax_topk", "decoder_sparse_step / mlp_only_layers"),
        MoEFamily("qwen2_moe", "num_experts", "softmax_topk", "decoder_sparse_step / mlp_only_layers", shared="gated"),
        MoEFamily("qwen3_next", "num_experts", "softmax_topk", "decoder_sparse_step / mlp_only_layers", shared="gated"),
        # the language models of the vision families (their vision side: rlcore.models.vision)
        MoEFamily("qwen3_vl_moe", "num_experts", "softmax_topk", "decoder_sparse_step / mlp_only_layers"),
        MoEFamily(
            "qwen3_5_moe", "num_experts", "softmax_topk", "linear-attention layers keep a MoE MLP", shared="gated"
        ),
        MoEFamily("mixtral", "num_local_experts", "softmax_topk"),
        MoEFamily(
            "gpt_oss",
            "num_local_experts",
            "topk_softmax",
            expert_bias=True,
            note="attention sinks and sliding windows: transformers' own attention only (no varlen kernel, no CP)",
        ),
        MoEFamily(
            "deepseek_v3",
            "n_routed_experts",
            "sigmoid_group",
            "first_k_dense_replace",
            shared="added",
            vllm_fused_experts=False,
        ),
        MoEFamily("glm4_moe", "n_routed_experts", "sigmoid_group", "first_k_dense_replace", shared="added"),
    )
}
FAMILIES.update({f"{name}_text": FAMILIES[name] for name in ("qwen3_vl_moe", "qwen3_5_moe")})  # text_config's type
"""Families whose MoE blocks rlcore replaces by its own (`rlcore.trainer.moe.MoEBlock`)."""

NO_VARLEN = ("gpt_oss",)
"""Families whose attention rlcore's varlen kernel does not compute (sinks, sliding windows)."""


def family_names() -> list[str]:
    """The model types of the families, as a user names them (a VLM's, not its text config's)."""
    return sorted(k for k in FAMILIES if not k.endswith("_text"))


def text_arch(arch: dict) -> dict:
    """The language model's keys of a config dict (a VLM's ``text_config``, else itself)."""
    text = arch.get("text_config")
    return {"model_type": arch.get("model_type"), **text} if isinstance(text, dict) and text else arch


def num_routed_experts(arch: dict) -> int:
    """Routed experts of a config dict by any family's key (0: dense)."""
    a = text_arch(arch)
    fam = FAMILIES.get(str(a.get("model_type", "")))
    if fam is not None:
        return int(a.get(fam.experts_key) or 0)
    return max((int(a.get(k) or 0) for k in EXPERT_COUNT_KEYS), default=0)


def moe_arch(arch: dict) -> MoEFamily | None:
    """The adapter of a config dict's model type, or None (dense, or a family rlcore has no adapter for)."""
    return FAMILIES.get(str(text_arch(arch).get("model_type", "")))


def moe_problem(arch: dict) -> str | None:
    """Why rlcore cannot shard / replay this MoE config (None: it can, or the model is dense).

    Checked: an adapter exists for the model type, and the config has the family's keys."""
    experts = num_routed_experts(arch)
    if experts == 0:
        return None
    a = text_arch(arch)
    mt = a.get("model_type")
    fam = FAMILIES.get(str(mt))
    if fam is None:
        return (
            f"model_type {mt!r} is a mixture-of-experts family rlcore has no MoE adapter for (router kind, "
            f"expert layout and shared experts unknown; rlcore/models/moe_family.py); supported: {family_names()}"
        )
    missing = [k for k in (fam.experts_key, fam.top_k_key) if not a.get(k)]
    if fam.router == "sigmoid_group":
        n_group = int(a.get("n_group") or 1)
        if experts % n_group:
            return f"{mt}: n_routed_experts={experts} is not a multiple of n_group={n_group}"
    if missing:
        return f"{mt}: the config has no {' / '.join(missing)}"
    return None


def moe_parallel_problems(arch: dict, ep: int, cp: int) -> list[tuple[str, str]]:
    """(key, message) for `trainer.ep` / `trainer.cp` on this config: expert parallelism needs a
    family rlcore can shard; a family whose attention rlcore's varlen kernel does not compute
    (gpt-oss: sinks, sliding windows) trains without context parallelism."""
    out = []
    problem = moe_problem(arch)
    if ep > 1 and problem:
        out.append(("trainer.ep", f"expert parallelism (ep={ep}) cannot shard this model: {problem}"))
    model_type = text_arch(arch).get("model_type")
    if cp > 1 and model_type in NO_VARLEN:
        out.append(
            (
                "trainer.cp",
                f"{model_type}: context parallelism runs in rlcore's varlen attention, which does "
                "not compute this family's attention sinks and sliding windows; use trainer.cp=1",
            )
        )
    return out


# -- the module side: a built model's MoE blocks ----------------------------------------------------

ROUTER_ATTRS = ("gate", "router")
SHARED_ATTRS = ("shared_experts", "shared_expert", "shared_expert_gate")


def find_router(block: Any) -> tuple[str, Any] | None:
    """(attribute, module) of a block's router: a child with ``top_k`` and a 2-D ``weight``."""
    for attr in ROUTER_ATTRS:
        r = getattr(block, attr, None)
        w = getattr(r, "weight", None)
        if r is not None and hasattr(r, "top_k") and getattr(w, "ndim", 0) == 2:
            return attr, r
    return None


def is_moe_block(block: Any) -> bool:
    """A routed-expert block: a router and fused 3-D experts (``gate_up_proj``, ``down_proj``)."""
    ex = getattr(block, "experts", None)
    return (
        find_router(block) is not None
        and ex is not None
        and getattr(getattr(ex, "gate_up_proj", None), "ndim", 0) == 3
        and getattr(getattr(ex, "down_proj", None), "ndim", 0) == 3
    )


def router_kind(router: Any) -> RouterKind:
    """The routing a transformers router computes, from its attributes."""
    if hasattr(router, "e_score_correction_bias"):
        return "sigmoid_group"
    if getattr(router, "bias", None) is not None:  # gpt-oss: top-k of the biased logits, softmax over the k
        return "topk_softmax"
    return "softmax_topk"


def block_parts(block: Any, family: str) -> dict[str, str]:
    """{role: attribute} of a MoE block (roles: router, experts, shared_experts, shared_gate).

    Raises ValueError naming the family and every child module rlcore does not know: a block with
    a part rlcore would drop (another gate, a second expert set) is refused, never trained wrong."""
    found = find_router(block)
    parts = {"router": found[0], "experts": "experts"}
    for attr in ("shared_experts", "shared_expert"):
        if getattr(block, attr, None) is not None:
            parts["shared_experts"] = attr
    if getattr(block, "shared_expert_gate", None) is not None:
        parts["shared_gate"] = "shared_expert_gate"
    known = set(parts.values())
    unknown = [name for name, _ in block.named_children() if name not in known]
    if unknown:
        raise ValueError(
            f"{family}: MoE block {type(block).__name__} has parts rlcore's MoE layer does not "
            f"compute: {unknown} (known: router, experts, shared experts and their gate)"
        )
    ex = block.experts
    if not hasattr(ex, "num_experts"):
        raise ValueError(f"{family}: experts module {type(ex).__name__} has no num_experts")
    if "shared_gate" in parts and "shared_experts" not in parts:
        raise ValueError(f"{family}: MoE block {type(block).__name__} has a shared-expert gate but no shared expert")
    return parts
