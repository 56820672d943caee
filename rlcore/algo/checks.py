"""Range checks shared by `algo.*` validation and the losses' own checks (torch-free).

Each returns ``(key, message)`` pairs, empty when the value is fine, so a validator can report
every problem at once and name the key.
"""

from __future__ import annotations

Problem = tuple[str, str]


def at_least(key: str, value: float, low: float, why: str = "") -> list[Problem]:
    """``value >= low`` (nan fails)."""
    # Written as `not (value >= low)` so that nan fails too.
    if not (value >= low):
        return [(key, f"must be >= {low}, got {value}{'; ' + why if why else ''}")]
    return []


def between(key: str, value: float, low: float, high: float, why: str = "") -> list[Problem]:
    """``low <= value <= high`` (nan fails)."""
    if not (low <= value <= high):
        return [(key, f"must be in [{low}, {high}], got {value}{'; ' + why if why else ''}")]
    return []


def clip_eps(prefix: str, low: float, high: float) -> list[Problem]:
    """A ratio clip ``[1 - low, 1 + high]`` set by keys ``{prefix}_low`` / ``{prefix}_high``:
    ``low`` in [0, 1] (1 = no lower bound), ``high`` >= 0."""
    return between(f"{prefix}_low", low, 0.0, 1.0, "the lower clip 1 - eps must stay >= 0") + at_least(
        f"{prefix}_high", high, 0.0
    )
