"""Environments for `benchmarks/reward_overhead.py`, importable by name from the rollout actors
(`env.name=benchmarks.reward_envs:HangingReverseText`)."""

from __future__ import annotations

import time
import zlib

from rlcore.envs.reverse_text import ReverseText
from rlcore.types import Task


class HangingReverseText(ReverseText):
    """reverse_text whose reward hangs (sleeps an hour) on `hang_percent`% of tasks (chosen by
    the task id's CRC32), the case of issue 41: only the reward timeout ends those calls."""

    def __init__(self, hang_percent: int = 30, **kw):
        super().__init__(**kw)
        self.hang_percent = int(hang_percent)

    def reward(self, task: Task, completion: str) -> float:
        if zlib.crc32(task.id.encode()) % 100 < self.hang_percent:
            time.sleep(3600)
        return super().reward(task, completion)
