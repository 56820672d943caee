"""Builtin environments register themselves on import."""

from rlcore.envs import alphabet_sort, math_env, mini_swe, reverse_text, shape_count, tool_use, verifiers_env, wordle  # noqa: F401
from rlcore.envs.base import Environment, make_env, registered
from rlcore.envs.multiturn import MultiTurnEnvironment
from rlcore.envs.tools import ToolEnvironment

__all__ = ["Environment", "MultiTurnEnvironment", "ToolEnvironment", "make_env", "registered"]
