"""Builtin environments register themselves on import (`rlcore.envs.catalog` imports them)."""

from rlcore.envs.base import Environment
from rlcore.envs.catalog import make_env, registered, resolve_env
from rlcore.envs.multiturn import MultiTurnEnvironment
from rlcore.envs.tools import ToolEnvironment

__all__ = ["Environment", "MultiTurnEnvironment", "ToolEnvironment", "make_env", "registered", "resolve_env"]
