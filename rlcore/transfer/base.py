"""The interface every weight transport implements: a trainer-side :class:`Sender` and an
engine-side :class:`Receiver` over one `SyncPlan` (`rlcore.transfer.plan`).

Both sides are built with the same inputs, whether a transport uses them or not: the run's
config, the plan, the group's rendezvous (`address`, `port`, hosted by the sender; its
`world_size`) and each side's own part (the sender's device; the receiver's engine, its first
rank in the group, and the sender's `handle`). Per sync the sender's `send` and every receiver's
`receive` run together (a collective transport) or one after the other (a buffered one, see
:attr:`Sender.buffered`).
"""

from __future__ import annotations

import abc
import time
from typing import TYPE_CHECKING, ClassVar, Iterator

if TYPE_CHECKING:
    import torch

    from rlcore.config import RunConfig
    from rlcore.engine.base import RolloutEngine
    from rlcore.transfer.plan import SyncPlan


class Sender(abc.ABC):
    """Trainer side: lives on trainer rank 0, or on every rank where :attr:`every_rank`."""

    every_rank: ClassVar[bool] = False
    """Every trainer rank sends, each to the engine on its own GPU; False: rank 0 sends to every
    engine and the other ranks only take part in the parameter gathers."""
    buffered: ClassVar[bool] = False
    """`send` writes a buffer the engines read afterwards (no engine takes part in it), so a train
    step can send its new weights before it returns and the sync is the engines' receive alone;
    False: `send` and the engines' `receive` must run at once."""

    @abc.abstractmethod
    def __init__(self, cfg: RunConfig, plan: SyncPlan, device: str, address: str, port: int,
                 world_size: int):
        """Join (host, as rank 0) the group of `world_size` ranks at `address`:`port` on `device`,
        blocking until every receiver joined (at most `rollout.weight_sync_timeout_s`)."""

    @abc.abstractmethod
    def send(self, named: Iterator[tuple[str, torch.Tensor]]) -> int:
        """Send every tensor of the plan, as (name, tensor) in plan order (DTensors are gathered
        one at a time); returns the bytes sent."""

    def handle(self) -> dict | None:
        """What each receiver needs from this sender beyond the rendezvous (a buffer's handle);
        None for a transport that needs nothing."""
        return None


class Receiver(abc.ABC):
    """Engine side: lives in a rollout actor, next to its engine."""

    @abc.abstractmethod
    def __init__(self, cfg: RunConfig, plan: SyncPlan, engine: RolloutEngine, address: str, port: int,
                 rank: int, world_size: int, handle: dict | None = None):
        """Join the group at `address`:`port` from `rank` on (taking :meth:`ranks_per_actor`
        ranks), at the same time as the sender; `handle`: the sender's :meth:`Sender.handle`."""

    @abc.abstractmethod
    def receive(self, version: int) -> dict[str, float]:
        """Receive one sync into the engine, which then serves it as policy `version`; returns
        timings in seconds (`sync_*` metrics)."""

    @classmethod
    def ranks_per_actor(cls, cfg: RunConfig) -> int:
        """Group ranks one rollout actor takes."""
        return 1


def engine_timings(start: float, times: dict[str, float]) -> dict[str, float]:
    """A receive the engine ran itself: `sync_engine_s` (seconds since `start`) plus the engine's
    own timings, each prefixed `sync_`."""
    return {"sync_engine_s": time.perf_counter() - start, **{f"sync_{k}": v for k, v in times.items()}}
