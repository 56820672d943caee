"""What a weight transport and an engine agree on, and nothing else: the engine-side
:class:`Receiver`, the :class:`Seat` it is built for, and the :class:`TransferOptions` both
sides read.

A leaf module (standard library only, no torch): `rlcore.transfer` (the senders, the transport
table) and `rlcore.engine` (the engines, each with its own receivers) both import it and never
each other. The types live here rather than in `rlcore.types` because that module holds the data
of a rollout (tasks, samples, groups), which neither side of a weight sync needs.

How a receiver comes to be. The rollout actor asks the transport table
(`rlcore.transfer.make_receiver`) for the receiver of its seat; the table asks the engine first
(:meth:`ReceivingEngine.receiver`, the engine's one hook for every transport) and falls back to
the transport's own receiver, which lands weights in any engine through `apply_weights`. A
transport whose receiving end lives inside the engine (vLLM's workers join an NCCL group, or
open a CUDA IPC buffer) has no receiver of its own: the engine must bring one.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Iterable, Protocol


@dataclass(frozen=True)
class TransferOptions:
    """The part of a run's config that the senders and receivers of a weight sync read."""

    timeout_s: float
    """Longest wait of any blocking step of a sync: a rendezvous, a bucket, an engine's receive
    (`rollout.weight_sync_timeout_s`)."""
    bucket_bytes: int
    """Bytes per bucket on the wire (`rollout.sync_bucket_mb`, in bytes)."""
    receive_device: str = "cpu"
    """Where a rollout actor's own receive buffers live: `cuda` when it holds GPUs, else `cpu`."""


@dataclass(frozen=True)
class Seat:
    """One rollout actor's place in a weight-sync group and what every sync holds."""

    transport: str
    """The transport's name (a key of `rlcore.transfer.PAIRS`)."""
    options: TransferOptions
    """Timeout and bucket size, the sender's too."""
    address: str
    """Rendezvous host (the sender hosts it); unused by a transport without a group."""
    port: int
    """Rendezvous port."""
    rank: int
    """The first group rank this actor takes (the sender is rank 0)."""
    world_size: int
    """Ranks in the group, the sender's included."""
    layout: Any
    """What one sync holds, in the transport's own terms (its sender's `layout`): the
    `SyncPlan` itself, or e.g. vLLM's packed `update_info` dict for `nccl` / `ipc`."""
    handle: dict | None = None
    """What this actor needs from the sender beyond the rendezvous (a CUDA IPC buffer's handle);
    None when the transport needs nothing."""


class Receiver(abc.ABC):
    """Engine side of a weight sync: built once per group as `Receiver(seat, engine)` (building
    joins the group, at the same time as the sender), then :meth:`receive` once per sync."""

    @abc.abstractmethod
    def receive(self, version: int) -> dict[str, float]:
        """Receive one sync into the engine, which then serves it as policy `version`; returns
        timings in seconds, named as `sync_*` metrics."""


class ReceivingEngine(Protocol):
    """What the transport table needs of an engine (every `RolloutEngine` has both)."""

    def receiver(self, transport: str, seat: Seat) -> Receiver | None:
        """The engine's own receiver for `transport`, joined at `seat`; None: it has none (the
        transport's own receiver, if any, then lands the weights through :meth:`apply_weights`)."""

    def apply_weights(self, named_tensors: Iterable[tuple[str, Any]], version: int) -> None:
        """Load a complete set of full tensors, by trainer name, and serve them as `version`."""
