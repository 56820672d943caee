"""Trainer switches and their config-time checks, torch-free so validation runs before torch loads."""

from __future__ import annotations

import importlib.util

AC_MODES = ("none", "full", "selective")
"""Values of ``trainer.activation_checkpointing``."""
PARAM_DTYPE_NAMES = ("float32", "bfloat16")
"""Values of ``trainer.param_dtype``."""
FP8_RECIPES = ("none", "tensorwise", "rowwise")
"""Values of ``trainer.fp8``: off, one scale per tensor, or one scale per row (torchao recipes)."""
SCHEDULES = ("constant", "linear", "cosine")
"""Values of ``trainer.lr_schedule``."""


def torchao_available() -> bool:
    return importlib.util.find_spec("torchao") is not None


def mesh_problems(dp, cp: int, ep: int, world_size: int, num_experts: int | None = None,
                  num_heads: int | None = None) -> list[tuple[str, str]]:
    """Config-time checks of the mesh (no torch.distributed needed); one (key, message) each.
    ``num_experts`` / ``num_heads`` None: unknown yet (a hub model), not checked; 0 experts: dense."""
    out = []
    if cp < 1:
        out.append(("trainer.cp", f"must be >= 1, got {cp}"))
    if ep < 1:
        out.append(("trainer.ep", f"must be >= 1, got {ep}"))
    if out:
        return out
    if dp is not None and dp < 1:
        return [("trainer.dp", f"must be >= 1 or null, got {dp}")]
    if dp is None and world_size % cp:
        out.append(("trainer.cp", f"must divide trainer.world_size={world_size}, got {cp}"))
    if dp is not None and dp * cp != world_size:
        out.append(("trainer.dp", f"dp * cp must equal trainer.world_size: {dp} * {cp} != {world_size}"))
    if world_size % ep:
        out.append(("trainer.ep", f"must divide dp * cp = trainer.world_size={world_size}, got {ep}"))
    if ep > 1 and num_experts == 0:
        out.append(("trainer.ep", f"expert parallelism (ep={ep}) needs a MoE model (num_experts > 0)"))
    elif ep > 1 and num_experts and num_experts % ep:
        out.append(("trainer.ep", f"must divide the model's num_experts={num_experts}, got {ep}"))
    if cp > 1 and num_heads and num_heads % cp:
        out.append(("trainer.cp", f"Ulysses context parallelism splits attention heads: cp={cp} must "
                    f"divide num_attention_heads={num_heads}"))
    return out


def schedule_problems(trainer_cfg) -> list[tuple[str, str]]:
    t = trainer_cfg
    out = []
    if t.lr_schedule not in SCHEDULES:
        out.append(("trainer.lr_schedule", f"unknown schedule {t.lr_schedule!r}; choose one of {list(SCHEDULES)}"))
    if t.warmup_steps < 0:
        out.append(("trainer.warmup_steps", f"must be >= 0, got {t.warmup_steps}"))
    if not 0.0 <= t.min_lr_ratio <= 1.0:
        out.append(("trainer.min_lr_ratio", f"must be in [0, 1], got {t.min_lr_ratio}"))
    return out
