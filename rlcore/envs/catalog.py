"""Environments by name: the builtin ones (each module imported when its name is first asked for)
and any `package.module:ClassName`. Validation, the driver and the rollout actors look them up here.

Builtin modules are imported on demand, not all at once, so that a process that serves one
environment (a reward zygote unpickling it, a rollout actor) imports that environment alone."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from rlcore.envs.base import ENV_CLASSES, Environment

if TYPE_CHECKING:
    from rlcore.config.reward import RewardRuntimeConfig
    from rlcore.config.schema import EnvConfig

BUILTIN: dict[str, str] = {
    "alphabet_sort": "rlcore.envs.alphabet_sort",
    "math": "rlcore.envs.math_env",
    "mini_swe": "rlcore.envs.mini_swe",
    "reverse_text": "rlcore.envs.reverse_text",
    "shape_count": "rlcore.envs.shape_count",
    "tool_use": "rlcore.envs.tool_use",
    "verifiers": "rlcore.envs.verifiers_env",
    "wordle": "rlcore.envs.wordle",
}
"""Builtin environment name -> the module whose `@register(name)` defines it."""


def registered() -> dict[str, type[Environment]]:
    """Every builtin environment (their modules imported, so registered) and any registered since."""
    for module in BUILTIN.values():
        importlib.import_module(module)
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
    if name not in ENV_CLASSES and name in BUILTIN:
        importlib.import_module(BUILTIN[name])
    return ENV_CLASSES.get(name)


def make_env(
    name: str, args: dict[str, Any], seed: int, reward_runtime: RewardRuntimeConfig | None = None
) -> Environment:
    """Environment `name` built from its own arguments (`env.args`), the task seed and the reward
    runtime's section (`env.reward`; None = its defaults). KeyError for an unknown name."""
    cls = resolve_env(name)
    if cls is None:
        raise KeyError(
            f"env.name: unknown environment {name!r}; choose one of {sorted(registered())} or give module:Class"
        )
    return cls(seed=seed, reward_runtime=reward_runtime, **args)


def build_env(section: EnvConfig) -> Environment:
    """The environment a run's `env` section describes (`make_env` of its name, args, seed and reward)."""
    return make_env(section.name, dict(section.args), section.seed, section.reward)
