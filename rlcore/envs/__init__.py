"""Environments: the contract (:mod:`.base`), the builtin ones, and lookup by name (:mod:`.catalog`).

Names are resolved on first use (PEP 562), so importing one environment's module imports neither
the catalogue nor the other environments."""

from __future__ import annotations

import importlib
from typing import Any

_NAMES = {
    "Environment": "rlcore.envs.base",
    "build_env": "rlcore.envs.catalog",
    "make_env": "rlcore.envs.catalog",
    "registered": "rlcore.envs.catalog",
    "resolve_env": "rlcore.envs.catalog",
    "MultiTurnEnvironment": "rlcore.envs.multiturn",
    "ToolEnvironment": "rlcore.envs.tools",
}
__all__ = sorted(_NAMES)


def __getattr__(name: str) -> Any:
    if name not in _NAMES:
        raise AttributeError(f"module 'rlcore.envs' has no attribute {name!r}")
    return getattr(importlib.import_module(_NAMES[name]), name)
