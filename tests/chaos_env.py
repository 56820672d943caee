"""Environments whose reward code or start-up misbehaves (for the chaos and start-up tests);
imported by the rollout actors as `tests.chaos_env:NAME`."""

import itertools
import os
import time
import zlib

from rlcore.envs.reverse_text import ReverseText


def bucket(task_id: str) -> int:
    return zlib.crc32(task_id.encode()) % 16


class HangingReverseText(ReverseText):
    """reverse_text whose reward hangs for 1 task in 8 (longer than the reward timeout)."""

    def reward(self, task, completion):
        if zlib.crc32(task.id.encode()) % 8 == 0:
            time.sleep(3.0)
        return super().reward(task, completion)


class ChaosReverseText(ReverseText):
    """reverse_text whose reward, by task: hangs in a sleep loop (2 in 16), raises (2 in 16),
    busy-loops (1 in 16), returns a string (1 in 16), prints 1 MB then scores (1 in 16)."""

    def reward(self, task, completion):
        b = bucket(task.id)
        if b in (0, 1):
            while True:
                time.sleep(0.01)
        if b in (2, 3):
            raise ValueError(f"reward bug on {task.id}")
        if b == 4:
            while True:
                pass
        if b == 5:
            return "good"
        if b == 6:
            print("x" * (1 << 20))
        return super().reward(task, completion)


class RaisingReverseText(ReverseText):
    """reverse_text whose reward fails at once on some tasks, for two reasons: it raises (2 in
    16) or returns a string (1 in 16)."""

    def reward(self, task, completion):
        b = bucket(task.id)
        if b in (2, 3):
            raise ValueError(f"reward bug on {task.id}")
        if b == 5:
            return "good"
        return super().reward(task, completion)


class AlwaysRaises(ReverseText):
    """reverse_text whose reward raises on every sample."""

    def reward(self, task, completion):
        raise KeyError("answer")


class BusyReverseText(ReverseText):
    """reverse_text whose reward busy-loops inside one C call for 1 task in 8 (past any timeout;
    no request to stop reaches it)."""

    def reward(self, task, completion):
        if zlib.crc32(task.id.encode()) % 8 == 0:
            return sum(itertools.repeat(1, 10**13))
        return super().reward(task, completion)


class SleepingReverseText(ReverseText):
    """reverse_text whose reward sleeps (past any timeout) for 1 task in 8: the same failures
    as BusyReverseText, without using a CPU."""

    def reward(self, task, completion):
        if zlib.crc32(task.id.encode()) % 8 == 0:
            time.sleep(600)
        return super().reward(task, completion)


def in_actor() -> bool:
    """Whether this code runs inside a Ray actor (a rollout or teacher actor), not the driver."""
    import ray

    return ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None


class GatedStartReverseText(ReverseText):
    """reverse_text whose construction inside an actor waits until the file `gate` exists (the
    test creates it once the SFT warm-up has begun): an engine that can only finish starting
    while the trainer works. No gate within `gate_timeout_s`: the construction raises."""

    def __init__(self, seed: int = 0, gate: str = "", gate_timeout_s: float = 120.0, **kw):
        super().__init__(seed, **kw)
        if gate and in_actor():
            deadline = time.monotonic() + gate_timeout_s
            while not os.path.exists(gate):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"start-up gate {gate} not opened within {gate_timeout_s:g}s")
                time.sleep(0.1)


class BrokenStartReverseText(GatedStartReverseText):
    """reverse_text whose construction inside an actor fails `delay_s` after the `gate` file
    exists (at once without a gate): an engine that breaks during start-up, while the driver's
    SFT warm-up runs (the test opens the gate when the warm-up begins)."""

    def __init__(self, seed: int = 0, delay_s: float = 0.0, **kw):
        super().__init__(seed, **kw)
        if in_actor():
            time.sleep(delay_s)
            raise RuntimeError("engine broke during start-up")


class GatedReverseText(ReverseText):
    """reverse_text whose reward, for every `gated_every`-th task (train index 0, n, 2n ...),
    waits until the file `gate` exists: a hang whose end the test decides, not a clock."""

    def __init__(self, gate: str = "", gated_every: int = 4, **kw):
        super().__init__(**kw)
        self.gate, self.gated_every = gate, int(gated_every)

    def reward(self, task, completion):
        if int(task.id.rsplit("/", 1)[1]) % self.gated_every == 0:
            while not os.path.exists(self.gate):
                time.sleep(0.01)
        return super().reward(task, completion)
