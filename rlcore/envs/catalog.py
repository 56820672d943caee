"""Environments by name: the builtin ones (registered by importing their modules here) and any
`package.module:ClassName`. Validation, the driver and the rollout actors look them up here."""

from __future__ import annotations

import importlib
from typing import Any

from rlcore.envs import (  # noqa: F401  (each registers itself on import)
    alphabet_sort,
    math_env,
    mini_swe,
    reverse_text,
    shape_count,
    tool_use,
    verifiers_env,
    wordle,
)
from rlcore.envs.base import ENV_CLASSES, Environment


def registered() -> dict[str, type[Environment]]:
    """The builtin environments (imported above, so registered) and any registered since."""
    return dict(ENV_CLASSES)


def resolve_env(name: str) -> type[Environment] | None:
    """A registered name, or `package.module:ClassName` for a user's own environment (imported
    in every process that needs it, so it must be importable on the whole cluster)."""
    if ":" in name:
        module, _, attr = name.partition(":")
        try:
            cls = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError):
            return None
        return cls if isinstance(cls, type) and issubclass(cls, Environment) else None
    return registered().get(name)


def make_env(name: str, args: dict[str, Any], seed: int) -> Environment:
    cls = resolve_env(name)
    if cls is None:
        raise KeyError(f"env.name: unknown environment {name!r}; choose one of {sorted(registered())} "
                       "or give module:Class")
    return cls(seed=seed, **args)
