"""Builtin environments register themselves on import."""

from rlcore.envs import reverse_text  # noqa: F401
from rlcore.envs.base import Environment, make_env, registered

__all__ = ["Environment", "make_env", "registered"]
