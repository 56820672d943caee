"""Range and consistency checks of ``algo.*``, run before anything starts.

:func:`validate_algo` returns ``(key, message)`` pairs, empty when the config is valid, so the
config validator can report every problem at once and name the key.
"""

from __future__ import annotations

from rlcore.algo.checks import Problem, at_least, between, choice, clip_eps
from rlcore.algo.names import LENGTH_PENALTIES, MIS_LEVELS
from rlcore.algo.registry import estimator_problems, loss_problems
from rlcore.config import AlgoConfig


def _objective(cfg: AlgoConfig) -> list[Problem]:
    problems = estimator_problems(cfg)
    problems += loss_problems(cfg)  # the selected loss, and each loss's own section
    problems += at_least("algo.group_size", cfg.group_size, 2, "advantages are relative within a group")
    problems += at_least("algo.batch_groups", cfg.batch_groups, 1)
    problems += clip_eps("algo.clip_eps", cfg.clip_eps_low, cfg.clip_eps_high)
    problems += at_least("algo.kl_coef", cfg.kl_coef, 0.0)
    problems += at_least("algo.entropy_coef", cfg.entropy_coef, 0.0)
    return problems


def _corrections(cfg: AlgoConfig) -> list[Problem]:
    problems: list[Problem] = []
    if not (cfg.tis_cap == 0 or cfg.tis_cap >= 1):
        problems.append(
            (
                "algo.tis_cap",
                f"must be 0 (off) or >= 1, got {cfg.tis_cap}; a cap below 1 down-weights on-policy tokens",
            )
        )
    problems += choice("algo.mis_level", cfg.mis_level, MIS_LEVELS, "masked-IS level")
    problems += between("algo.mis_low", cfg.mis_low, 0.0, 1.0, "an on-policy token (ratio 1) must be kept")
    problems += at_least("algo.mis_high", cfg.mis_high, 1.0, "an on-policy token (ratio 1) must be kept")
    problems += between("algo.prob_diff_threshold", cfg.prob_diff_threshold, 0.0, 1.0, "0 is off")
    return problems


def _length_penalty(cfg: AlgoConfig) -> list[Problem]:
    problems = choice("algo.length_penalty", cfg.length_penalty, LENGTH_PENALTIES, "length penalty")
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
