"""Full, transformers-named parameters of a parallelized model, for weight sync and checks.

What leaves the trainer is exactly what the inference engine expects for the base model:

- FSDP2-sharded parameters are all-gathered (``DTensor.full_tensor``);
- expert weights ``...mlp.experts.{gate_up_proj,down_proj}`` (and gpt-oss's expert biases) of ep ranks are concatenated over the
  ep group along the expert dimension (``[E/ep, ...]`` -> ``[E, ...]``);
- LoRA-adapted linears are merged, ``W + s B A``, under the base name; adapters are not sent.

Every function here is collective when the model is sharded: all ranks iterate fully, in the
same order.
"""

from __future__ import annotations

from typing import Iterator

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from rlcore.trainer.lora import lora_modules, merge
from rlcore.trainer.moe import expert_modules


def _full(p: torch.Tensor) -> torch.Tensor:
    if not isinstance(p, DTensor):
        return p
    if p.device_mesh.size() == 1:  # one rank holds it whole: skip DTensor's redistribute (per tensor, it
        return p.to_local()  # dominated the colocated sync's trainer side)
    return p.full_tensor()


def _plan(model: torch.nn.Module):
    experts = {f"{name}.{leaf}": m for name, m in expert_modules(model).items() for leaf in m.leaves()}
    loras = lora_modules(model)
    adapters = {f"{name}.{leaf}" for name in loras for leaf in ("lora_A", "lora_B")}
    merged = {f"{name}.weight": m for name, m in loras.items()}
    return experts, adapters, merged


def full_parameters(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) in ``named_parameters`` order, adapters merged and skipped."""
    experts, adapters, merged = _plan(model)
    for name, param in model.named_parameters():
        if name in adapters:
            continue
        full = _full(param).detach()
        ex = experts.get(name)
        if ex is not None and ex.ep_size > 1:
            out = full.new_empty((ex.ep_size * full.shape[0], *full.shape[1:]))
            dist.all_gather_into_tensor(out, full.contiguous(), group=ex.ep_group)
            full = out
        lora = merged.get(name)
        if lora is not None:
            full = merge(full, _full(lora.lora_A).detach(), _full(lora.lora_B).detach(), lora.scale)
        yield name, full


def whole_parameters(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]] | None:
    """`full_parameters` as a list of aliases of this rank's own storage, when this rank holds
    every parameter whole (one rank: no sharding, no experts split over ep, no LoRA to merge);
    None otherwise. The aliases follow the optimizer's in-place updates, so one list serves every
    sync until the parameters themselves are replaced (a checkpoint load). No communication.

    Why: walking `named_parameters` and `DTensor.to_local` costs tens of microseconds per tensor,
    most of a colocated one-GPU sync for a model of a few hundred tensors."""
    experts, adapters, merged = _plan(model)
    if adapters or merged or any(ex.ep_size > 1 for ex in experts.values()):
        return None
    out = []
    for name, param in model.named_parameters():
        if isinstance(param, DTensor):
            if param.device_mesh.size() != 1:
                return None
            param = param.to_local()
        out.append((name, param.detach()))
    return out


def parameter_metas(model: torch.nn.Module) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, full shape, dtype) in `full_parameters` order; no communication."""
    experts, adapters, _ = _plan(model)
    out = []
    for name, p in model.named_parameters():
        if name in adapters:
            continue
        shape = tuple(p.shape)
        ex = experts.get(name)
        if ex is not None:
            shape = (ex.ep_size * shape[0], *shape[1:])
        out.append((name, shape, str(p.dtype).removeprefix("torch.")))
    return out


def persistent_buffers(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of the buffers a checkpoint holds (a sigmoid router's
    ``e_score_correction_bias``; not RoPE's ``inv_freq``): replicated on every rank, never sharded."""
    for prefix, module in model.named_modules():
        for name, buf in module.named_buffers(recurse=False):
            if buf is not None and name not in module._non_persistent_buffers_set:
                yield (f"{prefix}.{name}" if prefix else name), buf.detach()
