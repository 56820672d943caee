"""Loss sections of the config schema: each built-in loss's own options (`algo.dr_grpo.*`,
`algo.dapo.*`, `algo.gspo.*`, `algo.cispo.*`).

A loss reads its own section and the shared `algo.*` keys (the clip `clip_eps_low/high`, the
corrections, KL and entropy). :mod:`rlcore.algo.registry` names each loss's section and checks
its values. The flat keys these replaced (`algo.dapo_clip_eps_high`, ...) are refused with the
key they moved to (:data:`MOVED`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DrGrpoOptions:
    """Options of loss `dr_grpo` (`algo.loss=dr_grpo`)."""

    max_tokens: int = 0
    """Constant per-sample token normaliser L (loss = token sum / (samples * L)); 0 = rollout.sampling.max_new_tokens."""


@dataclass
class DapoOptions:
    """Options of loss `dapo` (`algo.loss=dapo`); its lower clip is the shared algo.clip_eps_low."""

    clip_eps_high: float = 0.28
    """Upper ratio clip (clip-higher, DAPO's 0.28): ratio <= 1 + clip_eps_high."""


@dataclass
class GspoOptions:
    """Options of loss `gspo` (`algo.loss=gspo`): the clip of its sequence ratio."""

    clip_eps_low: float = 3e-4
    """Lower clip of the sequence ratio: s >= 1 - clip_eps_low (GSPO paper: 3e-4)."""
    clip_eps_high: float = 4e-4
    """Upper clip of the sequence ratio: s <= 1 + clip_eps_high (GSPO paper: 4e-4)."""


@dataclass
class CispoOptions:
    """Options of loss `cispo` (`algo.loss=cispo`): the clip of its stop-gradient IS weight."""

    eps_low: float = 1.0
    """IS weight >= 1 - eps_low (1.0 = no lower bound, as in MiniMax-M1)."""
    eps_high: float = 3.0
    """IS weight <= 1 + eps_high (3.0 caps the weight at 4)."""


MOVED = {
    "dr_grpo_max_tokens": "dr_grpo.max_tokens",
    "dapo_clip_eps_high": "dapo.clip_eps_high",
    "gspo_clip_eps_low": "gspo.clip_eps_low",
    "gspo_clip_eps_high": "gspo.clip_eps_high",
    "cispo_eps_low": "cispo.eps_low",
    "cispo_eps_high": "cispo.eps_high",
}
"""The flat per-loss keys of `algo` before each loss had its section -> where they are now."""


def moved_loss_key(dotted: str) -> str | None:
    """`algo.<old flat key>` -> "moved to algo.<loss>.<option> (loss <loss>'s own section)"; None
    for any other key."""
    group, _, name = dotted.partition(".")
    home = MOVED.get(name) if group == "algo" else None
    return f"moved to algo.{home} (loss {home.partition('.')[0]}'s own section)" if home else None
