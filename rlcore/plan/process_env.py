"""Checks of the groups' `env_vars` (`trainer.env_vars`, `rollout.env_vars`, `teacher.env_vars`):
variables set in the group's actor processes through their Ray runtime_env, torch-free."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rlcore.config import RunConfig

NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
OWNED = {
    "CUDA_VISIBLE_DEVICES": "Ray assigns each actor its GPUs through it (set the group's gpus_per_* "
    "and placement instead)",
    "PYTHONPATH": "the actors get the driver's import path (set PYTHONPATH where you start the run)",
}
"""Variables rlcore or Ray set in every actor, with what to set instead."""


def env_var_problems(cfg: RunConfig) -> list[tuple[str, str]]:
    """Each group's `env_vars`: names a shell accepts, no `RLCORE_*` name (rlcore's own: the run
    config travels in one), none of `OWNED`, values that are strings, numbers or booleans."""
    out: list[tuple[str, str]] = []
    for group in ("trainer", "rollout", "teacher"):
        for name, value in getattr(cfg, group).env_vars.items():
            key = f"{group}.env_vars.{name}"
            if not NAME.match(str(name)):
                out.append((key, "not an environment variable name (letters, digits and _, not starting with a digit)"))
            elif str(name).upper().startswith("RLCORE_"):
                out.append((key, "RLCORE_* variables are rlcore's own (the run config reaches actors in one)"))
            elif name in OWNED:
                out.append((key, OWNED[name]))
            if not isinstance(value, (str, int, float, bool)):
                out.append((key, f"needs a string, number or boolean, got {type(value).__name__}"))
    return out


def group_env(env_vars: dict) -> dict[str, str]:
    """A group's `env_vars` as a runtime_env's `env_vars` (strings; booleans as 0/1)."""
    return {str(k): str(int(v)) if isinstance(v, bool) else str(v) for k, v in env_vars.items()}
