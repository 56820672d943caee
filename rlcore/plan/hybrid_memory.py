"""Hybrid models in the memory plan (`rlcore.plan.memory`), from `model.arch` alone: the layer
pattern, the parameters of their recurrent layers, and the recurrent state one sequence holds.

An attention layer's cache grows with the sequence; a recurrent layer (Gated DeltaNet in
Qwen3-Next / Qwen3.5, Mamba-2 in Nemotron-H) holds a fixed state per sequence: a causal-conv
window (``conv_dim x kernel``, model dtype) and the recurrent matrix (Gated DeltaNet:
``value heads x key dim x value dim``; Mamba-2: ``heads x head dim x state size``), kept in float32
(vLLM's ``mamba_ssm_cache_dtype`` default for both families). An engine holds one per sequence in
flight and per recurrent layer, whatever the sequence length.
"""

from __future__ import annotations

RECURRENT, ATTENTION, MLP, MOE = "recurrent", "attention", "mlp", "moe"
_NEMOTRON_KINDS = {
    "mamba": RECURRENT,
    "linear_attention": RECURRENT,
    "M": RECURRENT,
    "attention": ATTENTION,
    "full_attention": ATTENTION,
    "*": ATTENTION,
    "mlp": MLP,
    "-": MLP,
    "moe": MOE,
    "E": MOE,
}
STATE_BYTES = 4  # float32 recurrent matrices
CONV_BYTES = 2  # bf16 conv windows


def layer_pattern(a: dict) -> list[str] | None:
    """Per decoder layer, its token mixer (RECURRENT or ATTENTION; Nemotron-H's blocks may also be
    MLP or MOE alone); None for a model type that is not hybrid."""
    mt = str(a.get("model_type") or "").removesuffix("_text")  # a VLM's text_config: qwen3_5_moe_text
    if mt == "nemotron_h":
        raw = a.get("layers_block_type") or list(a.get("hybrid_override_pattern") or "")
        return [_NEMOTRON_KINDS[k] for k in raw] or None
    if mt in ("qwen3_next", "qwen3_5", "qwen3_5_moe"):
        if a.get("layer_types"):
            return [ATTENTION if t == "full_attention" else RECURRENT for t in a["layer_types"]]
        every = int(a.get("full_attention_interval") or 4)
        return [ATTENTION if (i + 1) % every == 0 else RECURRENT for i in range(int(a["num_hidden_layers"]))]
    return None


def _gdn_dims(a: dict) -> tuple[int, int, int, int, int]:
    """(key dim, value dim, value heads, conv dim, conv kernel) of a Gated DeltaNet layer."""
    kh, vh = int(a.get("linear_num_key_heads") or 16), int(a.get("linear_num_value_heads") or 32)
    kd = kh * int(a.get("linear_key_head_dim") or 128)
    vd = vh * int(a.get("linear_value_head_dim") or 128)
    return kd, vd, vh, 2 * kd + vd, int(a.get("linear_conv_kernel_dim") or 4)


def _mamba_dims(a: dict) -> tuple[int, int, int, int, int]:
    """(inner dim, heads, state size, conv dim, conv kernel) of a Mamba-2 layer."""
    heads, n = int(a.get("mamba_num_heads") or 128), int(a.get("ssm_state_size") or 128)
    inner = heads * int(a.get("mamba_head_dim") or 64)
    return inner, heads, n, inner + 2 * int(a.get("n_groups") or 8) * n, int(a.get("conv_kernel") or 4)


def recurrent_state_bytes(a: dict) -> int:
    """Bytes of recurrent state one sequence holds over all layers (0 for a non-hybrid model)."""
    pattern = layer_pattern(a) or []
    n = pattern.count(RECURRENT)
    if not n:
        return 0
    if a.get("model_type") == "nemotron_h":
        inner, heads, state, conv, k = _mamba_dims(a)
        matrix = inner * state  # heads x head dim x state size
    else:
        kd, vd, vh, conv, k = _gdn_dims(a)
        matrix = vh * (kd // int(a.get("linear_num_key_heads") or 16)) * (vd // vh)
    return n * (conv * k * CONV_BYTES + matrix * STATE_BYTES)


def hybrid_param_count(a: dict, vocab: int, active: bool = False) -> int | None:
    """Parameters of a hybrid decoder described by `a` (`model.arch`, text fields merged); None
    for a model type that is not hybrid. `active`: a MoE layer counts its top-k routed experts only."""
    pattern = layer_pattern(a)
    if pattern is None:
        return None
    h, heads = int(a["hidden_size"]), int(a["num_attention_heads"])
    hd = int(a.get("head_dim") or h // heads)
    q, kv = heads * hd, int(a.get("num_key_value_heads") or heads) * hd
    nemotron = a.get("model_type") == "nemotron_h"
    if nemotron:
        inner, mheads, state, conv, k = _mamba_dims(a)
        recurrent = (
            h * (2 * inner + 2 * int(a.get("n_groups") or 8) * state + mheads)
            + conv * (k + 1)
            + 3 * mheads
            + inner
            + inner * h
        )
        attention = h * q + 2 * h * kv + q * h
        experts = int(a.get("n_routed_experts") or 0)
        moe_inter = int(a.get("moe_intermediate_size") or 0)
        used = min(experts, int(a.get("num_experts_per_tok") or experts)) if active else experts
        moe = used * 2 * h * moe_inter + experts * h + 2 * h * int(a.get("moe_shared_expert_intermediate_size") or 0)
        mixer = {
            RECURRENT: recurrent,
            ATTENTION: attention,
            MLP: 2 * h * int(a.get("intermediate_size") or 4 * h),
            MOE: moe,
        }
        body = sum(mixer[kind] + h for kind in pattern)  # each block: one mixer and its norm
    else:
        kd, vd, vh, conv, k = _gdn_dims(a)
        recurrent = h * (2 * kd + 2 * vd + 2 * vh) + conv * k + 2 * vh + vd // vh + vd * h
        attention = h * 2 * q + 2 * h * kv + q * h + 2 * hd  # gated query (2q), q/k norms
        experts = int(a.get("num_experts") or 0)
        if experts:
            inter = int(a.get("moe_intermediate_size") or 512)
            shared = int(a.get("shared_expert_intermediate_size") or 0)
            used = min(experts, int(a.get("num_experts_per_tok") or experts)) if active else experts
            mlp = used * 3 * h * inter + experts * h + 3 * h * shared + h
        else:
            mlp = 3 * h * int(a.get("intermediate_size") or 4 * h)
        body = sum((recurrent if kind == RECURRENT else attention) + mlp + 2 * h for kind in pattern)
    tied = a.get("tie_word_embeddings", False) and not nemotron  # Nemotron-H never ties its head
    return body + vocab * h * (1 if tied else 2) + h
