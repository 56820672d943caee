"""Algorithms as pure functions on tensors: advantages, losses, mismatch corrections."""

from rlcore.algo.validate import validate_algo

__all__ = ["validate_algo"]
