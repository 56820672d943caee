"""The trainer side of every weight transport: a :class:`Sender` over one `SyncPlan`
(`rlcore.transfer.plan`). The engine side is a `rlcore.weights.protocol.Receiver`: the
transport's own (one that works for any engine) or the engine's (`RolloutEngine.receiver`).

A sender is built from the transfer options (`rlcore.weights.protocol.TransferOptions`), the
plan, its device and the group's rendezvous (`address`, `port`, which it hosts as rank 0, and the
group's `world_size`), whether a transport uses them or not. Per sync the sender's `send` and
every receiver's `receive` run together (a collective transport) or one after the other (a
buffered one, see :attr:`Sender.buffered`).
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any, ClassVar, Iterator

if TYPE_CHECKING:
    import torch

    from rlcore.transfer.plan import SyncPlan
    from rlcore.weights.protocol import TransferOptions


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
    def __init__(self, options: TransferOptions, plan: SyncPlan, device: str, address: str, port: int, world_size: int):
        """Join (host, as rank 0) the group of `world_size` ranks at `address`:`port` on `device`,
        blocking until every receiver joined (at most `options.timeout_s`)."""

    @abc.abstractmethod
    def send(self, named: Iterator[tuple[str, torch.Tensor]]) -> int:
        """Send every tensor of the plan, as (name, tensor) in plan order (DTensors are gathered
        one at a time); returns the bytes sent."""

    @classmethod
    def abort(cls, address: str, port: int) -> bool:
        """Make every member of the group at `address`:`port` give up the operation it waits in
        (a rendezvous or a send/receive that a member who died or froze holds), well before its
        deadline; the group is formed anew afterwards. Returns whether the members were told;
        False here: the transport's operations end only by their deadline (or never block on a
        peer: a buffered one)."""
        return False

    def handle(self) -> dict | None:
        """What each receiver needs from this sender beyond the rendezvous (a buffer's handle);
        None for a transport that needs nothing."""
        return None

    @classmethod
    def layout(cls, plan: SyncPlan, options: TransferOptions) -> Any:
        """What every receiver is told one sync holds (`Seat.layout`), in this wire's terms: the
        plan itself unless the wire describes it otherwise (vLLM's packed `update_info`)."""
        return plan
