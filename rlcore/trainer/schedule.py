"""Learning-rate schedules: linear warmup, then constant, linear or cosine decay over the run.

A `LambdaLR` whose multiplier is a pure function of the optimizer-step index, so the schedule
resumes exactly from the scheduler's saved `last_epoch` (see `rlcore.storage.checkpoint`).
"""

from __future__ import annotations

import math

import torch

from rlcore.config import TrainerConfig
from rlcore.trainer.options import SCHEDULES


def lr_multiplier(step: int, schedule: str, warmup_steps: int, total_steps: int, min_ratio: float) -> float:
    """Multiplier of the base learning rate for optimizer step `step` (0-based)."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    span = max(1, total_steps - warmup_steps - 1)
    progress = min(1.0, max(0.0, (step - warmup_steps) / span))
    if schedule == "linear":
        return min_ratio + (1.0 - min_ratio) * (1.0 - progress)
    if schedule == "cosine":
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"trainer.lr_schedule: unknown schedule {schedule!r}; choose one of {list(SCHEDULES)}")


def build_scheduler(
    optimizer: torch.optim.Optimizer, trainer_cfg: TrainerConfig, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    t = trainer_cfg
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_multiplier(s, t.lr_schedule, t.warmup_steps, total_steps, t.min_lr_ratio)
    )
