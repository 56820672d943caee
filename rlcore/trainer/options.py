"""Trainer switches and their config-time checks, torch-free so validation runs before torch loads."""

from __future__ import annotations

import importlib.util

from rlcore.config import TrainerConfig
from rlcore.config.bounds import choices_of

# the vocabularies are written on the schema's fields (rlcore/config/schema.py)
AC_MODES = choices_of(TrainerConfig, "activation_checkpointing")
"""Values of ``trainer.activation_checkpointing``."""
PARAM_DTYPE_NAMES = choices_of(TrainerConfig, "param_dtype")
"""Values of ``trainer.param_dtype``."""
FP8_RECIPES = choices_of(TrainerConfig, "fp8")
"""Values of ``trainer.fp8``: off, one scale per tensor, or one scale per row (torchao recipes)."""
SCHEDULES = choices_of(TrainerConfig, "lr_schedule")
"""Values of ``trainer.lr_schedule``."""


def torchao_available() -> bool:
    return importlib.util.find_spec("torchao") is not None


def mesh_problems(
    dp, cp: int, ep: int, world_size: int, num_experts: int | None = None, num_heads: int | None = None
) -> list[tuple[str, str]]:
    """Config-time checks of the mesh (no torch.distributed needed); one (key, message) each.
    ``num_experts`` / ``num_heads`` None: unknown yet (a hub model), not checked; 0 experts: dense.
    A degree below 1 is its field's bound (`rlcore.config.bounds`): nothing more is said of it here."""
    out = []
    if cp < 1 or ep < 1 or (dp is not None and dp < 1):
        return out
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
        out.append(
            (
                "trainer.cp",
                f"Ulysses context parallelism splits attention heads: cp={cp} must "
                f"divide num_attention_heads={num_heads}",
            )
        )
    return out
