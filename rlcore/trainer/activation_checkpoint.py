"""Activation checkpointing of decoder layers: ``none``, ``full`` or ``selective``.

- ``full``: a layer keeps only its input; the whole layer is recomputed in backward
  (memory ~ one hidden state per layer, compute ~ +1 forward of the layers).
- ``selective``: op-level selective checkpointing. Outputs of matmuls, attention kernels and
  collectives (the expensive or communicating ops) are saved; norms, activations, RoPE and other
  elementwise ops are recomputed. Cheaper in compute than ``full``, lighter than ``none``.

The checkpoint is applied by replacing the layer *instance's* ``forward`` rather than wrapping the
module, so parameter names stay the transformers names (``model.layers.0.self_attn.q_proj.weight``,
not ``..._checkpoint_wrapped_module...``) for weight sync and checkpoints. FSDP2's hooks run in
``__call__`` around this forward, so parameters are all-gathered before the recomputation too.
"""

from __future__ import annotations

import functools
import importlib

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from rlcore.models.vision import decoder_layers
from rlcore.trainer.options import AC_MODES as MODES


def _saved_ops() -> set:
    aten = torch.ops.aten
    names = [
        (aten, "mm"),
        (aten, "addmm"),
        (aten, "bmm"),
        (aten, "linear"),
        (aten, "_scaled_mm"),  # _scaled_mm: FP8 GEMMs
        (aten, "_scaled_dot_product_efficient_attention"),
        (aten, "_scaled_dot_product_flash_attention"),
        (aten, "_scaled_dot_product_cudnn_attention"),
        (aten, "_flash_attention_forward"),
        (aten, "_efficient_attention_forward"),
        (aten, "_scaled_dot_product_flash_attention_for_cpu"),
        (torch.ops._c10d_functional, "all_to_all_single"),
        (torch.ops._c10d_functional, "all_gather_into_tensor"),
    ]
    try:
        importlib.import_module("torch.nn.attention.varlen")  # registers the torch_attn ops
        names.append((torch.ops.torch_attn, "_varlen_attn"))
    except ImportError:
        pass
    out = set()
    for ns, name in names:
        packet = getattr(ns, name, None)
        if packet is not None:
            out.add(packet.default)
    return out


@functools.lru_cache(maxsize=1)
def _save_set() -> frozenset:
    return frozenset(_saved_ops())


def _policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _save_set() else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context():
    return create_selective_checkpoint_contexts(_policy)


def checkpoint_module(module: torch.nn.Module, mode: str) -> None:
    """Make ``module``'s forward checkpointed (idempotent)."""
    if mode == "none" or getattr(module, "_rlcore_ac", None) == mode:
        return
    if mode not in MODES:
        raise ValueError(f"unknown activation checkpointing mode {mode!r}; choose one of {list(MODES)}")
    inner = module.forward
    kwargs = {"use_reentrant": False}
    if mode == "selective":
        kwargs["context_fn"] = _selective_context

    def forward(*args, **kw):
        if not torch.is_grad_enabled():  # nothing to save in no-grad forwards (reference, eval)
            return inner(*args, **kw)
        return checkpoint(inner, *args, **kwargs, **kw)

    module.forward = forward
    module._rlcore_ac = mode


def apply_activation_checkpointing(model: torch.nn.Module, mode: str) -> None:
    """Checkpoint every decoder layer of a transformers causal LM (``model.model.layers``)."""
    for layer in decoder_layers(model):
        checkpoint_module(layer, mode)
