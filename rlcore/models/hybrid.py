"""Hybrid models: decoder stacks where some layers are recurrent (Gated DeltaNet linear attention
in Qwen3-Next and Qwen3.5, Mamba-2 in Nemotron-H) and keep a state instead of a KV cache.

Packed training puts several samples in one row. Attention layers get the sample boundaries
(position ids restarting at 0, or ``cu_seq_lens_q``); a recurrent layer must restart its state
at each boundary too, or a sample reads its predecessor's state. transformers' torch reference
paths (the CPU path, and the GPU path without the fla / mamba_ssm kernels) ignore ``cu_seqlens``,
so `restart_state_at_boundaries` runs each recurrent layer once per packed sample instead.
"""

from __future__ import annotations

from typing import Any

HYBRID_MODEL_TYPES = ("qwen3_next", "nemotron_h", "qwen3_5", "qwen3_5_moe")
"""Model types (``model.arch.model_type``) whose decoder mixes recurrent and attention layers."""

BOUNDARY_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
"""The packed-row model kwargs (`rlcore.trainer.forward`) that name sample boundaries."""


def is_hybrid_arch(arch: dict) -> bool:
    """Whether a random-weight config (``model.arch``) or a checkpoint's config.json is hybrid."""
    return arch.get("model_type") in HYBRID_MODEL_TYPES


def local_model_type(path: str) -> str | None:
    """``model_type`` of a local checkpoint directory's config.json (None for a hub id or no file)."""
    import json
    from pathlib import Path

    found = Path(path).expanduser() / "config.json"
    if not found.is_file():
        return None
    try:
        return json.loads(found.read_text()).get("model_type")
    except (OSError, ValueError):
        return None  # unreadable: the model's own load reports it


def recurrent_mixers(model) -> list:
    """The recurrent token mixers of a causal LM or a VLM's language model: the children of its
    decoder layers that carry a causal ``conv1d`` (Gated DeltaNet's ``linear_attn``, Nemotron-H's
    Mamba-2 ``mixer``); empty for an attention-only model."""
    import torch

    from rlcore.models.vision import decoder_layers

    try:
        layers = decoder_layers(model)
    except AttributeError:
        return []
    return [m for layer in layers for m in layer.children() if isinstance(getattr(m, "conv1d", None), torch.nn.Conv1d)]


def is_hybrid_model(model) -> bool:
    """Whether ``model`` has recurrent mixers (cached on the model after the first look)."""
    found = getattr(model, "_rlcore_hybrid", None)
    if found is None:
        found = bool(recurrent_mixers(model))
        try:
            model._rlcore_hybrid = found
        except AttributeError:  # (a module that refuses attributes: look again next time)
            pass
    return found


def restart_state_at_boundaries(model) -> int:
    """Make every recurrent mixer of ``model`` restart its state at each packed sample: called
    with ``cu_seq_lens_q`` (one packed row, no cache), it runs once per sample and concatenates
    the outputs; any other call (generation with a cache, a plain batch) is unchanged.
    Idempotent; returns the number of mixers wrapped."""
    mixers = recurrent_mixers(model)
    for mixer in mixers:
        if not getattr(mixer, "_rlcore_restarts", False):
            mixer.forward = _per_sample(mixer.forward)
            mixer._rlcore_restarts = True
    return len(mixers)


def _per_sample(forward):
    import torch

    def run(*args: Any, **kwargs: Any):
        cu = kwargs.get("cu_seq_lens_q")
        if cu is None or kwargs.get("cache") is not None:
            return forward(*args, **kwargs)
        hidden = args[0] if args else kwargs.pop("hidden_states")
        args = args[1:]
        if hidden.shape[0] != 1:
            raise ValueError("packed recurrent layers expect one packed row (batch size 1)")
        rest = {k: v for k, v in kwargs.items() if k not in BOUNDARY_KWARGS}
        if rest.get("attention_mask") is not None:
            raise ValueError("a packed row carries no padding mask (boundaries come from cu_seq_lens_q)")
        # one host sync per layer call: the boundaries decide the Python loop
        lengths = (cu[1:] - cu[:-1]).tolist()
        if sum(lengths) != hidden.shape[1]:
            raise ValueError(f"cu_seq_lens_q covers {sum(lengths)} tokens, the row has {hidden.shape[1]}")
        outs = [forward(part, *args, **rest) for part in hidden.split(lengths, dim=1)]
        return torch.cat(outs, dim=1)

    return run
