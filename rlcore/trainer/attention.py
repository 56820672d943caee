"""Variable-length (packed) causal attention, registered as a transformers attention
implementation (``rlcore_varlen``), with optional Ulysses context parallelism.

Packed rows are described by cumulative sequence lengths ``cu`` (int32, ``[n+1]``, ``cu[0] = 0``,
``cu[-1] = T``): token ``i`` may attend to ``j`` iff both lie in the same ``[cu[k], cu[k+1])``
and ``j <= i``. They reach the attention function as the model kwargs ``cu_seq_lens_q`` /
``max_length_q`` (transformers forwards extra kwargs down to attention), so they are also
present when an activation-checkpointed layer is recomputed in backward.

Kernels: on CUDA ``torch.nn.attention.varlen.varlen_attn`` (flash/cuDNN varlen, no T x T
mask); elsewhere SDPA with an explicit block-diagonal causal mask (O(T^2) memory: fine for CPU
tests, not for long sequences).

Context parallelism (module attribute ``_rlcore_cp_group`` set): every rank holds a contiguous
``L = T / cp`` slice of the sequence. An all-to-all turns ``[H, L, D]`` (all heads, my tokens)
into ``[H / cp, T, D]`` (my heads, all tokens), attention runs over the whole packed row with the
global ``cu``, and a second all-to-all returns ``[H, L, D]``. Packed/varlen rows therefore need
no special handling; the restriction is ``cp | num_attention_heads`` (KV heads are repeated to
the query head count when ``cp`` does not divide ``num_key_value_heads``; otherwise grouped-query
attention keeps its fewer KV heads through the all-to-all and into the kernel).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed import _functional_collectives as fc

from rlcore.models.hybrid import is_hybrid_model
from rlcore.models.vision import decoder_layers, text_config

try:  # a custom op (torch_attn::_varlen_attn, fake kernel + backward): traces under torch.compile
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # older torch: CPU/SDPA path only
    varlen_attn = None

NAME = "rlcore_varlen"


def cu_seqlens(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Sequence boundaries of a packed row from its position ids (a sample starts wherever the
    position does not continue the previous one, e.g. resets to 0)."""
    pos = position_ids.reshape(-1)
    T = pos.numel()
    starts = torch.ones(T, dtype=torch.bool, device=pos.device)
    starts[1:] = pos[1:] != pos[:-1] + 1
    idx = torch.nonzero(starts).flatten()
    cu = torch.cat([idx, torch.tensor([T], device=pos.device)]).to(torch.int32)
    return cu, int((cu[1:] - cu[:-1]).max())


def _repeat_heads(x: torch.Tensor, n: int) -> torch.Tensor:
    return x if n == 1 else x.repeat_interleave(n, dim=0)


def _attend(q, k, v, cu: torch.Tensor, max_len: int, scale: float) -> torch.Tensor:
    """Causal attention within each packed sequence; q ``[h, T, D]``, k and v ``[h_kv, T, D]``
    with ``h_kv | h`` (grouped-query attention: query head i reads KV head ``i // (h / h_kv)``)
    -> ``[h, T, D]``. Both kernels take the KV heads as they are: no repeated copies of k and v
    (and no gradient sum over the copies) per layer."""
    if q.is_cuda:
        q, k, v = (t.transpose(0, 1).contiguous() for t in (q, k, v))  # [T, h, D]; no copy if already so
        out = varlen_attn(q, k, v, cu, cu, max_len, max_len, scale=scale, window_size=(-1, 0))
        return out.transpose(0, 1)
    T = q.shape[1]
    seq = torch.repeat_interleave(
        torch.arange(cu.numel() - 1, device=q.device), (cu[1:] - cu[:-1]).long(), output_size=T
    )
    mask = (seq[:, None] == seq[None, :]) & torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    return F.scaled_dot_product_attention(
        q[None], k[None], v[None], attn_mask=mask, scale=scale, enable_gqa=k.shape[0] != q.shape[0]
    )[0]


def heads_to_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``[H, L, D]`` (all heads, local tokens) -> ``[H / cp, cp * L, D]`` (local heads, all tokens)."""
    cp = dist.get_world_size(group)
    H, L, D = x.shape
    y = fc.all_to_all_single_autograd(x.reshape(cp, H // cp, L, D).contiguous().flatten(0, 1), None, None, group)
    return y.reshape(cp, H // cp, L, D).transpose(0, 1).reshape(H // cp, cp * L, D)


def sequence_to_heads(y: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Inverse of `heads_to_sequence`: ``[H / cp, cp * L, D]`` -> ``[H, L, D]``."""
    cp = dist.get_world_size(group)
    h, T, D = y.shape
    L = T // cp
    x = fc.all_to_all_single_autograd(
        y.reshape(h, cp, L, D).transpose(0, 1).contiguous().flatten(0, 1), None, None, group
    )
    return x.reshape(cp * h, L, D)


def varlen_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention interface: query ``[1, H, L, D]``, key/value ``[1, Hkv, L, D]``;
    returns ``([1, L, H, D], None)``."""
    if query.shape[0] != 1:
        raise ValueError("rlcore_varlen attention expects one packed row (batch size 1)")
    cu, max_len = kwargs.get("cu_seq_lens_q"), kwargs.get("max_length_q")
    if cu is None:
        raise ValueError("rlcore_varlen attention needs cu_seq_lens_q / max_length_q model kwargs")
    group = getattr(module, "_rlcore_cp_group", None)
    cp = dist.get_world_size(group) if group is not None else 1
    q, k, v = query[0], key[0], value[0]
    H, Hkv = q.shape[0], k.shape[0]
    if Hkv % cp:  # each rank needs whole KV heads for its query heads: repeat to H first
        k, v = _repeat_heads(k, H // Hkv), _repeat_heads(v, H // Hkv)
    if group is not None:
        # contiguous head blocks keep the GQA grouping: query block r uses KV block r
        q, k, v = (heads_to_sequence(t, group) for t in (q, k, v))
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    # max_len stays as given (a Python int from `cu_seqlens`; a SymInt under torch.compile's
    # dynamic shapes, which int() would specialise into a recompile per value)
    out = _attend(q, k, v, cu.to(q.device), max_len, scale)
    if group is not None:
        out = sequence_to_heads(out, group)
    return out.transpose(0, 1)[None], None


def use_varlen_attention(model: torch.nn.Module, cp_group: dist.ProcessGroup | None) -> None:
    """Switch a transformers model to `varlen_attention` (and Ulysses over ``cp_group``)."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, varlen_attention)
    # a VLM: the language model only (its vision tower attends bidirectionally within images)
    text_config(model.config)._attn_implementation = NAME
    layers = decoder_layers(model)
    if cp_group is not None and is_hybrid_model(model):  # a hub model: validation could not see its type
        raise ValueError(
            f"trainer.cp: {text_config(model.config).model_type} is a hybrid model (linear-attention / "
            "Mamba layers): context parallelism cannot split their recurrent state yet; use trainer.cp=1"
        )
    for layer in layers:
        attn = getattr(layer, "self_attn", None)  # hybrid models: recurrent layers do not attend
        if attn is not None:
            attn._rlcore_cp_group = cp_group
