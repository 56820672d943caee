"""Driver steps of colocated placement (trainer rank i and engine i on GPU i): the CUDA IPC
weight group, the two-phase sync, and sleep / wake of the hybrid synchronous schedule.

Unlike NCCL (both sides must join at once), IPC is ordered: each trainer rank writes its buffer
and returns, then each engine reads the buffer on its own GPU. `get` is the driver's `ray.get`
with a timeout and participant names (`actors.driver.get`).
"""

from __future__ import annotations

from typing import Callable

from actors.groups import Groups
from rlcore.transfer.plan import SyncPlan


def _names(groups: Groups) -> tuple[list[str], list[str]]:
    return ([f"trainer rank {i}" for i in range(len(groups.trainers))],
            [f"rollout actor {i}" for i in range(len(groups.rollouts))])


def init_ipc_group(groups: Groups, plan: SyncPlan, get: Callable, timeout_s: float,
                   serving: list[int] | None = None) -> None:
    """Every trainer rank makes its IPC buffer (once); engine i of `serving` (default: all)
    keeps the handle of trainer rank i."""
    trainers, rollouts = _names(groups)
    serving = list(range(len(groups.rollouts))) if serving is None else serving
    handles = get([tr.init_weight_group.remote("", 0, plan) for tr in groups.trainers], timeout_s,
                  "weight buffers (IPC) init", trainers)
    get([groups.rollouts[i].init_weight_group.remote("", 0, plan, handles[i]) for i in serving], timeout_s,
        "weight receivers (IPC) init", [rollouts[i] for i in serving])


def sync_ipc(groups: Groups, version: int, get: Callable, timeout_s: float,
             serving: list[int] | None = None, pushed: list[dict] | None = None) -> list[dict]:
    """Trainer ranks fill their buffers (all at once: the parameter gathers are collective),
    then every engine of `serving` (default: all) lands them as `version`. Returns the trainers'
    then the engines' results. `pushed`: the trainers' results when their train step already
    filled the buffers with `version` (then the sync is one call, the engines' receive)."""
    trainers, rollouts = _names(groups)
    serving = list(range(len(groups.rollouts))) if serving is None else serving
    if pushed is None:
        pushed = get([tr.push_weights.remote() for tr in groups.trainers], timeout_s,
                     f"weight sync to version {version} (trainer buffers)", trainers)
    pulled = get([groups.rollouts[i].pull_weights.remote(version) for i in serving], timeout_s,
                 f"weight sync to version {version} (engines)", [rollouts[i] for i in serving])
    return pushed + pulled


def sleep_engines(groups: Groups, level: int, get: Callable, timeout_s: float) -> float:
    """Put every engine to sleep before the trainer steps; returns the slowest engine's seconds."""
    return max(get([r.sleep.remote(level) for r in groups.rollouts], timeout_s, "engine sleep", _names(groups)[1]))


def wake_engines(groups: Groups, get: Callable, timeout_s: float) -> float:
    """Wake every engine after the step, before the sync refills its weights."""
    return max(get([r.wake_up.remote() for r in groups.rollouts], timeout_s, "engine wake-up", _names(groups)[1]))
