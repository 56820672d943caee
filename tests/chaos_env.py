"""An environment with a reward function that sometimes hangs (for the chaos test); imported by
the rollout actors as `tests.chaos_env:HangingReverseText`."""

import time
import zlib

from rlcore.envs.reverse_text import ReverseText


class HangingReverseText(ReverseText):
    """reverse_text whose reward hangs for 1 task in 8 (longer than the reward timeout)."""

    def reward(self, task, completion):
        if zlib.crc32(task.id.encode()) % 8 == 0:
            time.sleep(3.0)
        return super().reward(task, completion)
