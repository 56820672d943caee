"""LoRA adapters for the linear layers of dense models.

A targeted ``nn.Linear`` (weight ``W`` [out, in], bias ``b``) becomes `LoRALinear`::

    y = x W^T + b + s * (dropout(x) A^T) B^T,     A [r, in], B [out, r], s = alpha / r

``B`` starts at zero (the adapted model equals the base model at step 0), ``A`` Kaiming-uniform
from a fixed seed (identical on every rank, as FSDP2 requires). ``W`` and ``b`` keep their names
and are frozen, as is every other base parameter; only ``lora_A`` / ``lora_B`` are trained.

Weight sync: the engines receive merged full weights ``W' = W + s B A`` under the base names
(see `rlcore.trainer.export`), so any engine works unchanged and the adapter names never leave
the trainer. Syncing adapters only (vLLM's LoRA adapters) is not implemented.
MoE expert weights (fused 3-D tensors, not ``nn.Linear``) are not adapted.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from rlcore.config import LoRAConfig

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoRALinear(nn.Module):
    """A frozen linear layer plus a trainable low-rank update (formula in the module docstring)."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float = 0.0):
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight  # same Parameter: name and storage unchanged
        self.bias = base.bias
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)
        kw = {"dtype": base.weight.dtype, "device": base.weight.device}
        self.lora_A = nn.Parameter(torch.empty(rank, self.in_features, **kw))
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, rank, **kw))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.scale = alpha / rank
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (
            F.linear(x, self.weight, self.bias)
            + F.linear(F.linear(self.dropout(x), self.lora_A), self.lora_B) * self.scale
        )

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, rank={self.lora_A.shape[0]}, scale={self.scale:g}"


def merge(weight: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor, scale: float) -> torch.Tensor:
    """``W + scale * B @ A`` computed in float32, returned in ``weight``'s dtype."""
    return (weight.float() + scale * (lora_B.float() @ lora_A.float())).to(weight.dtype)


def apply_lora(model: nn.Module, cfg: LoRAConfig, seed: int = 0) -> list[str]:
    """Freeze ``model`` and adapt every ``nn.Linear`` whose last name component is in
    ``cfg.target_modules`` (``cfg``: rank, alpha, dropout, target_modules). Returns the adapted
    module names; raises if none matched."""
    targets = set(cfg.target_modules or DEFAULT_TARGETS)
    model.requires_grad_(False)
    found = [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and name.rsplit(".", 1)[-1] in targets and not name.endswith("lm_head")
    ]
    if not found:
        raise ValueError(f"trainer.lora.target_modules {sorted(targets)} matched no nn.Linear in the model")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for name, m in found:
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, LoRALinear(m, cfg.rank, cfg.alpha, cfg.dropout))
    return [name for name, _ in found]


def lora_modules(model: nn.Module) -> dict[str, LoRALinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}
