"""Range and consistency checks of ``algo.*``, run before anything starts.

:func:`validate_algo` returns ``(key, message)`` pairs, empty when the config is valid, so the
config validator can report every problem at once and name the key.
"""

from __future__ import annotations

from rlcore.algo.names import ESTIMATORS, LENGTH_PENALTIES, LOSSES, MIS_LEVELS
from rlcore.config import AlgoConfig

Problem = tuple[str, str]


def _choice(key: str, value: str, choices: tuple[str, ...], what: str) -> list[Problem]:
    if value in choices:
        return []
    return [(key, f"unknown {what} {value!r}; choose one of {', '.join(choices)}")]


def _at_least(key: str, value: float, low: float, why: str = "") -> list[Problem]:
    # Written as `not (value >= low)` so that nan fails too.
    if not (value >= low):
        return [(key, f"must be >= {low}, got {value}{'; ' + why if why else ''}")]
    return []


def _between(key: str, value: float, low: float, high: float, why: str = "") -> list[Problem]:
    if not (low <= value <= high):
        return [(key, f"must be in [{low}, {high}], got {value}{'; ' + why if why else ''}")]
    return []


def _clip_eps(prefix: str, low: float, high: float) -> list[Problem]:
    """A ratio clip ``[1 - low, 1 + high]``: ``low`` in [0, 1] (1 = no lower bound), ``high`` >= 0."""
    return _between(f"algo.{prefix}_low", low, 0.0, 1.0, "the lower clip 1 - eps must stay >= 0") + _at_least(
        f"algo.{prefix}_high", high, 0.0
    )


def _objective(cfg: AlgoConfig) -> list[Problem]:
    problems = _choice("algo.name", cfg.name, ESTIMATORS, "advantage estimator")
    problems += _choice("algo.loss", cfg.loss, LOSSES, "loss")
    problems += _at_least("algo.group_size", cfg.group_size, 2, "advantages are relative within a group")
    problems += _at_least("algo.batch_groups", cfg.batch_groups, 1)
    problems += _clip_eps("clip_eps", cfg.clip_eps_low, cfg.clip_eps_high)
    problems += _at_least("algo.dapo_clip_eps_high", cfg.dapo_clip_eps_high, 0.0)
    problems += _clip_eps("gspo_clip_eps", cfg.gspo_clip_eps_low, cfg.gspo_clip_eps_high)
    problems += _clip_eps("cispo_eps", cfg.cispo_eps_low, cfg.cispo_eps_high)
    problems += _at_least("algo.dr_grpo_max_tokens", cfg.dr_grpo_max_tokens, 0)
    if cfg.loss == "dr_grpo" and cfg.name == "grpo" and cfg.std_normalize:
        problems.append(
            (
                "algo.std_normalize",
                "Dr.GRPO removes the std normalisation: set algo.std_normalize=false with algo.loss=dr_grpo",
            )
        )
    problems += _at_least("algo.kl_coef", cfg.kl_coef, 0.0)
    problems += _at_least("algo.entropy_coef", cfg.entropy_coef, 0.0)
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
    problems += _choice("algo.mis_level", cfg.mis_level, MIS_LEVELS, "masked-IS level")
    problems += _between("algo.mis_low", cfg.mis_low, 0.0, 1.0, "an on-policy token (ratio 1) must be kept")
    problems += _at_least("algo.mis_high", cfg.mis_high, 1.0, "an on-policy token (ratio 1) must be kept")
    problems += _between("algo.prob_diff_threshold", cfg.prob_diff_threshold, 0.0, 1.0, "0 is off")
    return problems


def _length_penalty(cfg: AlgoConfig) -> list[Problem]:
    problems = _choice("algo.length_penalty", cfg.length_penalty, LENGTH_PENALTIES, "length penalty")
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
        problems += _at_least("algo.overlong_penalty", cfg.overlong_penalty, 0.0)
    if cfg.length_penalty == "linear" and not cfg.length_penalty_per_token > 0:
        problems.append(("algo.length_penalty_per_token", "must be > 0 with algo.length_penalty=linear"))
    return problems


def validate_algo(cfg: AlgoConfig) -> list[Problem]:
    """Every problem of ``cfg`` (an ``AlgoConfig`` or the ``algo`` node of a composed config)
    as ``(key, message)``; empty when valid. ``max_off_policy_steps`` is the driver's to check."""
    return _objective(cfg) + _corrections(cfg) + _length_penalty(cfg)
