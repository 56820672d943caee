"""Health alarms over a run's step rows: the signs people look for in curves, said in words.

Each alarm compares the last `WINDOW` train rows (and, where a trend matters, the `WINDOW` before
them). Pure functions of the rows: the page shows what they return.
"""

from __future__ import annotations

from statistics import fmean
from typing import Any

WINDOW = 10
FLAT_REWARD = 0.02
"""Reward means of two windows closer than this count as flat."""
ENTROPY_COLLAPSE = 0.3
"""Entropy that fell by more than this share between two windows has collapsed."""
BOUND_SHARE = 0.5
"""A canary gap above this share of its calibrated bound is close to it."""
ZERO_ADV_SHARE = 0.5
"""More than this share of groups with one reward (no advantage) is most of the batch."""
STALE_SHARE = 0.2
"""More than this share of the window's generated samples dropped as stale."""
IDLE_BUSY = 0.3
"""A side busy less than this share of the step is idle most of it."""


def _mean(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
    return fmean(values) if values else None


def alarms(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The alarms raised by the last train rows: `{"id", "step", "text"}` each (`id` names the
    check: reward_flat_entropy_collapse, canary_near_bound, zero_advantage, stale_drops, idle)."""
    train = [r for r in rows if "reward_mean" in r]
    if not train:
        return []
    last, prev, step = train[-WINDOW:], train[-2 * WINDOW : -WINDOW], train[-1]["step"]
    out: list[dict[str, Any]] = []

    def raise_(id_: str, text: str) -> None:
        out.append({"id": id_, "step": step, "text": text})

    if len(prev) == WINDOW:
        r0, r1 = _mean(prev, "reward_mean"), _mean(last, "reward_mean")
        e0, e1 = _mean(prev, "entropy"), _mean(last, "entropy")
        if None not in (r0, r1, e0, e1) and abs(r1 - r0) < FLAT_REWARD and e0 > 0 and (e0 - e1) / e0 > ENTROPY_COLLAPSE:
            raise_(
                "reward_flat_entropy_collapse",
                f"reward flat ({r0:.3f} -> {r1:.3f}) while entropy collapses ({e0:.3f} -> {e1:.3f})",
            )
    for gap, limit in (("canary_mean_gap", "canary_mean_limit"), ("canary_max_gap", "canary_max_limit")):
        g, b = train[-1].get(gap), train[-1].get(limit)
        if isinstance(g, (int, float)) and isinstance(b, (int, float)) and b > 0 and g / b > BOUND_SHARE:
            raise_("canary_near_bound", f"{gap} {g:.3g} is {100 * g / b:.0f}% of its calibrated bound {b:.3g}")
    zero = _mean(last, "zero_adv_frac")
    if zero is not None and zero > ZERO_ADV_SHARE:
        raise_(
            "zero_advantage",
            f"{100 * zero:.0f}% of groups had one reward for all samples (no advantage) "
            f"over the last {len(last)} steps",
        )
    first = prev[-1] if prev else None
    if first is not None and all(
        isinstance(r.get(k), (int, float))
        for r in (first, last[-1])
        for k in ("samples_dropped_stale", "samples_generated")
    ):
        dropped = last[-1]["samples_dropped_stale"] - first["samples_dropped_stale"]
        generated = last[-1]["samples_generated"] - first["samples_generated"]
        if generated > 0 and dropped / generated > STALE_SHARE:
            raise_(
                "stale_drops",
                f"{100 * dropped / generated:.0f}% of the samples generated over the last "
                f"{len(last)} steps were dropped as stale",
            )
    for side in ("trainer", "rollout"):
        busy = _mean(last, f"{side}_busy_frac")
        if busy is not None and busy < IDLE_BUSY:
            raise_(
                "idle",
                f"the {side} side was busy {100 * busy:.0f}% of the step (idle most of it) "
                f"over the last {len(last)} steps",
            )
    return out
