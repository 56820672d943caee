"""Range and consistency checks of ``algo.*``, run before anything starts.

:func:`validate_algo` returns ``(key, message)`` pairs, empty when the config is valid, so the
config validator can report every problem at once and name the key.
"""

from __future__ import annotations

from rlcore.algo.checks import Problem, at_least
from rlcore.algo.registry import estimator_problems, loss_problems
from rlcore.config import AlgoConfig


def _objective(cfg: AlgoConfig) -> list[Problem]:
    problems = estimator_problems(cfg)
    problems += loss_problems(cfg)  # the selected loss, and each loss's own section
    return problems  # group_size, batch_groups, the clip, kl/entropy coefs: bounds on their fields


def _corrections(cfg: AlgoConfig) -> list[Problem]:
    problems: list[Problem] = []
    if not (cfg.tis_cap == 0 or cfg.tis_cap >= 1):
        problems.append(
            (
                "algo.tis_cap",
                f"must be 0 (off) or >= 1, got {cfg.tis_cap}; a cap below 1 down-weights on-policy tokens",
            )
        )
    return problems  # mis_level, mis_low/high, prob_diff_threshold: bounds on their fields


def _length_penalty(cfg: AlgoConfig) -> list[Problem]:
    problems: list[Problem] = []  # the allowed values of length_penalty are on its field
    if cfg.length_penalty == "overlong":
        if not cfg.overlong_max_tokens > 0:
            problems.append(
                (
                    "algo.overlong_max_tokens",
                    "must be > 0 with algo.length_penalty=overlong (usually max_new_tokens)",
                )
            )
        if not 0 < cfg.overlong_buffer_tokens <= max(cfg.overlong_max_tokens, 0):
            problems.append(
                (
                    "algo.overlong_buffer_tokens",
                    f"must be in (0, algo.overlong_max_tokens={cfg.overlong_max_tokens}] "
                    f"with algo.length_penalty=overlong, got {cfg.overlong_buffer_tokens}",
                )
            )
        problems += at_least("algo.overlong_penalty", cfg.overlong_penalty, 0.0)
    if cfg.length_penalty == "linear" and not cfg.length_penalty_per_token > 0:
        problems.append(("algo.length_penalty_per_token", "must be > 0 with algo.length_penalty=linear"))
    return problems


def validate_algo(cfg: AlgoConfig) -> list[Problem]:
    """Every problem of ``cfg`` (an ``AlgoConfig`` or the ``algo`` node of a composed config)
    as ``(key, message)``; empty when valid. ``max_off_policy_steps`` is a run-level key,
    checked with the run in :func:`rlcore.plan.validate.validate`."""
    return _objective(cfg) + _corrections(cfg) + _length_penalty(cfg)
