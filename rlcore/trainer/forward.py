"""One packed micro-batch through a parallelized model: per-token logprobs and entropies.

``logp[i]`` is the logprob of ``targets[i]`` after ``input_ids[:i + 1]`` within the same packed
sample (the `rlcore.batch.packing` alignment), under ``softmax(logits / temperature)``; both outputs
are float32 ``[T]`` and differentiable. With ``cp > 1`` the row is split over the context
ranks and the outputs are gathered back to ``[T]`` on each (`rlcore.trainer.context_parallel`).

With routing replay (``mb.routed_experts``) the model's MoE blocks use the given experts
(`rlcore.trainer.moe.set_routing`; the pad sample and -1 rows route themselves), in the image
forward too: its rows are the packed ``input_ids``, image placeholder tokens included (the
language model runs every position, the image's embeddings in the placeholders' places; the
engines route and report those positions like any prompt token).

A vision model sharded over several ranks runs its tower in a micro-batch without images too, on a
blank image whose outputs enter at 0 weight (`rlcore.trainer.idle_tower`): its FSDP collectives
must pair with those of a rank whose micro-batch has images.

Hybrid models (`rlcore.models.hybrid`) get the sample boundaries as ``cu_seq_lens_q`` too: their
recurrent layers restart their state at each packed sample.

The row the model sees is padded (one trailing pad sample, cut off again) to a multiple of
``cp * token_multiple(model)``: FP8 matmuls need every GEMM dimension, the token count included
(it is the inner dimension of the weight-gradient GEMM), to be a multiple of 16.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from rlcore.batch.packing import MicroBatch
from rlcore.batch.routing import SELF_ROUTE
from rlcore.models.hybrid import is_hybrid_model
from rlcore.models.vision import packed_mrope_positions, pixel_values, text_config
from rlcore.trainer.attention import NAME as VARLEN
from rlcore.trainer.attention import cu_seqlens
from rlcore.trainer.context_parallel import gather_sequence, local_slice, pad_to_multiple
from rlcore.trainer.idle_tower import idle_tower, needs_idle_tower
from rlcore.trainer.logprobs import logprob_request
from rlcore.trainer.moe import set_routing
from rlcore.trainer.packed_mask import packed_mask_kwargs
from rlcore.trainer.parallel import TOKEN_MULTIPLE_ATTR, Meshes


def token_multiple(model: torch.nn.Module) -> int:
    """The multiple the packed token count must be padded to for this model's matmuls (set by
    `rlcore.trainer.parallel.parallelize`; 16 with FP8 linears, else 1)."""
    return int(getattr(model, TOKEN_MULTIPLE_ATTR, 1))


def forward_logprobs(
    model: torch.nn.Module, mb: MicroBatch, temperature: float, meshes: Meshes | None, device: torch.device, vision=None
) -> tuple[torch.Tensor, torch.Tensor]:
    logp, entropy, _ = forward_columns(model, mb, temperature, meshes, device, vision)
    return logp, entropy


def forward_columns(
    model: torch.nn.Module,
    mb: MicroBatch,
    temperature: float,
    meshes: Meshes | None,
    device: torch.device,
    vision=None,
    others: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """:func:`forward_logprobs` plus, with ``others`` (long [T, k], on the host like the
    micro-batch), the logprobs [T, k] of those tokens at each position (None without)."""
    if mb.images:
        if token_multiple(model) > 1:
            raise ValueError("FP8 training of a vision-language model is not supported (trainer.fp8)")
        return _vision_forward(model, mb, temperature, device, vision, others)
    # padding, slicing and sequence boundaries on the host (a MicroBatch's tensors live there):
    # no device sync; the few index tensors are copied without blocking
    ids, pos, tgt = mb.input_ids, mb.position_ids, mb.targets
    T = ids.numel()
    group = meshes.cp_group if meshes is not None else None
    cp = meshes.dims.cp if group is not None else 1
    ids, pos, tgt = pad_to_multiple(ids, pos, tgt, cp * token_multiple(model))
    if others is not None and len(others) < len(ids):  # the pad sample asks for token 0
        others = torch.cat([others, others.new_zeros((len(ids) - len(others), others.shape[1]))])
    routed = mb.routed_experts
    if routed is not None and len(routed) < len(ids):  # the pad sample routes itself
        routed = torch.cat([routed, routed.new_full((len(ids) - len(routed), *routed.shape[1:]), SELF_ROUTE)])
    full_pos = pos
    if group is not None:
        rank = torch.distributed.get_rank(group)
        ids, pos, tgt = (local_slice(t, rank, cp) for t in (ids, pos, tgt))
        routed = local_slice(routed, rank, cp) if routed is not None else None
        others = local_slice(others, rank, cp) if others is not None else None
    set_routing(model, routed.to(device, non_blocking=True) if routed is not None else None)
    kwargs = {}
    # varlen attention and recurrent (hybrid) layers both read the boundaries from these kwargs
    if getattr(text_config(model.config), "_attn_implementation", None) == VARLEN or is_hybrid_model(model):
        # boundaries of the *whole* row: with cp, attention runs over all of it (Ulysses)
        cu, max_len = cu_seqlens(full_pos)
        cu = cu.to(device, non_blocking=True)
        kwargs = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": max_len, "max_length_k": max_len}
    ids, pos, tgt = (t.to(device, non_blocking=True) for t in (ids, pos, tgt))
    others = others.to(device, non_blocking=True) if others is not None else None
    if not kwargs:  # the model's own attention: a family that cannot find the packed sequences gets masks
        kwargs = packed_mask_kwargs(model, pos[None], model.get_input_embeddings().weight.dtype)
    # a vision model's tower runs on every rank: its FSDP collectives pair with an image rank's
    tower = meshes is not None and needs_idle_tower(model, meshes.fsdp.size())
    with logprob_request(model, tgt, temperature, others), idle_tower(model, device) if tower else nullcontext():
        out = model(input_ids=ids[None], position_ids=pos[None], use_cache=False, **kwargs)
    columns = out.logits[0]
    if group is not None:
        columns = gather_sequence(columns, group)
    return _split(columns[:T], others is not None)


def _split(columns: torch.Tensor, has_others: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The head's [T, 2 (+ k)] output as (logp, entropy, other tokens' logprobs or None)."""
    return columns[:, 0], columns[:, 1], columns[:, 2:] if has_others else None


def _vision_forward(
    model: torch.nn.Module,
    mb: MicroBatch,
    temperature: float,
    device: torch.device,
    vision,
    others: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A micro-batch with images (cp == 1, checked at config time): pixel values of all its
    images, 3-D mrope positions computed per sample, and sample boundaries passed explicitly
    (mrope positions do not restart/continue like 1-D ones; ``mb.position_ids`` still do)."""
    if vision is None:
        raise ValueError("micro-batch has images but the policy is not a vision-language model")
    pixels, grids = pixel_values(mb.images, vision)
    mrope = packed_mrope_positions(mb.input_ids, mb.sample_index, grids, vision)
    ids, tgt = mb.input_ids.to(device), mb.targets.to(device)
    routed = mb.routed_experts  # one row per position of the (unpadded) row, placeholders included
    if routed is not None and len(routed) != len(ids):
        raise ValueError(f"routing replay: {len(routed)} routed rows for a row of {len(ids)} tokens")
    set_routing(model, routed.to(device, non_blocking=True) if routed is not None else None)
    cu, max_len = cu_seqlens(mb.position_ids)  # on the host, as in the text path: no device sync
    cu = cu.to(device, non_blocking=True)
    kwargs = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": max_len, "max_length_k": max_len}
    others = others.to(device) if others is not None else None
    with logprob_request(model, tgt, temperature, others):
        out = model(
            input_ids=ids[None],
            position_ids=mrope[:, None, :].to(device),
            pixel_values=pixels.to(device),
            image_grid_thw=grids.to(device),
            use_cache=False,
            **kwargs,
        )
    return _split(out.logits[0], others is not None)
