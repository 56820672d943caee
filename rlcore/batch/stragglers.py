"""When a group that is still scoring stops holding a place in the staleness budget.

A generate request generates all its groups in one engine call, then scores them side by side,
and each group is delivered once scored (`Environment.stream_groups`, `actors.rollout_stream`;
an environment with an episode loop of its own delivers its groups together, so none of them
is ever overdue). So once a request has delivered its first
group, the rest of it only scores: a group still scoring long after that is a straggler (a slow
or hung reward). Counted against the staleness budget until its reward's deadline, stragglers
keep the engine from generating the groups the next steps need: with 30% of tasks hanging
until a 2 s deadline, most of the budget waited on rewards that then failed.

A straggler is *overdue* once the time since its request's first delivery exceeds
``max(MIN_S, FACTOR * median lag)``, a lag being how long after its request's first group a
group that was scored arrived (the last `WINDOW` such groups; a group whose every sample failed
tells of a deadline, not of scoring, and is left out). A threshold this low replaces some
groups that were only slow (they arrive, are trained if still fresh or dropped stale): on the
CPU hang case of issue 41 the 90th percentile times two replaced 7-10 groups a run and left the
run at 16.0 RL s, the median's replaced ~110 (dropping 3x the samples stale) and took
13.6-14.4 s. Until `MIN_LAGS` lags are known nothing is overdue (a run whose rewards are all
slow learns that before it launches extra). An overdue group stops counting against the budget, so
the driver launches a replacement. If it arrives later it is trained like any other group, or
dropped stale and counted: the staleness bound itself is enforced where groups are trained
(`rlcore.batch.buffer.RolloutBuffer`), so this only changes how much is generated, never what is trained.
"""

from __future__ import annotations

import statistics
from collections import deque

MIN_S = 0.5
"""The shortest lag that makes a group overdue (cheap rewards arrive within ms of each other)."""
FACTOR = 4.0
"""Overdue past this multiple of the median lag of scored groups (rewards slow by nature stay
counted)."""
MIN_LAGS = 8
"""Lags seen before any group can be overdue."""
WINDOW = 512
"""Lags remembered (the newest)."""


class ScoringLags:
    """The recent scoring lags of delivered groups and the overdue threshold they give."""

    def __init__(self) -> None:
        self._lags: deque[float] = deque(maxlen=WINDOW)

    def note(self, lag_s: float, scored: bool = True) -> None:
        """A group arrived `lag_s` seconds after its request's first group (0 for the first);
        `scored`: whether any of its samples was scored (only those lags count)."""
        if scored:
            self._lags.append(max(0.0, float(lag_s)))

    def overdue_after_s(self) -> float | None:
        """Seconds after its request's first delivery past which a group still scoring is
        overdue; None while fewer than `MIN_LAGS` lags are known."""
        if len(self._lags) < MIN_LAGS:
            return None
        return max(MIN_S, FACTOR * statistics.median(self._lags))
