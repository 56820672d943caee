"""Algorithms as pure functions on tensors: advantages, losses, mismatch corrections.

Losses and advantage estimators are registries (:mod:`rlcore.algo.registry`): a spec per
built-in, :func:`register_loss` / :func:`register_estimator` for more, or an import path
(`algo.loss=pkg.mod:fn`, `algo.name=pkg.mod:fn`).
"""

from rlcore.algo.registry import EstimatorSpec, LossSpec, register_estimator, register_loss
from rlcore.algo.validate import validate_algo

__all__ = ["EstimatorSpec", "LossSpec", "register_estimator", "register_loss", "validate_algo"]
