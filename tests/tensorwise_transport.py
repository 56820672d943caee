"""A weight transport from outside the package (the contract test of `tests/test_engine_plugin.py`
registers it with `rlcore.transfer.register_transport`): every tensor broadcast on its own, in
plan order, from rank 0 of a gloo group, no buckets.

It has no receiver of its own: an engine that takes it receives the wire itself (its
`receiver` hook). The wire, which is all the two sides share: a gloo group of `world_size`
ranks over a `TCPStore` hosted by the sender at the seat's address and port, one rank per
rollout actor; per sync, one broadcast per entry of the seat's layout, `(name, shape, dtype
name)` in order, each tensor in that shape and dtype.
"""

from __future__ import annotations

import datetime
from typing import Iterator

import torch
import torch.distributed as dist

from rlcore.transfer import base
from rlcore.transfer.plan import SyncPlan
from rlcore.weights.protocol import TransferOptions


def gloo_group(address: str, port: int, rank: int, world_size: int, timeout_s: float) -> tuple:
    """(group, broadcast timeout) of the wire; rank 0 hosts the store."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(address, port, world_size, is_master=(rank == 0), timeout=timeout)
    return dist.ProcessGroupGloo(store, rank, world_size, timeout), timeout


def broadcast(group, timeout: datetime.timedelta, tensor: torch.Tensor) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.timeout = 0, timeout
    group.broadcast([tensor], opts).wait(timeout)


class Sender(base.Sender):
    """Trainer rank 0: hosts the group, then broadcasts each tensor of the layout alone."""

    def __init__(self, options: TransferOptions, plan: SyncPlan, device: str, address: str, port: int, world_size: int):
        self.expect = self.layout(plan, options)
        self.group, self.timeout = gloo_group(address, port, 0, world_size, options.timeout_s)

    @classmethod
    def layout(cls, plan: SyncPlan, options: TransferOptions) -> list[tuple[str, tuple[int, ...], str]]:
        """`(name, shape, dtype name)` of every tensor, in plan order."""
        return [(m.name, m.shape, m.dtype) for b in plan.buckets for m in b.metas]

    def send(self, named: Iterator[tuple[str, torch.Tensor]]) -> int:
        sent = 0
        for i, (name, tensor) in enumerate(named):
            want = self.expect[i] if i < len(self.expect) else None
            full = getattr(tensor, "full_tensor", None)
            tensor = (full() if callable(full) else tensor).detach().contiguous()
            if want is None or (name, tuple(tensor.shape), str(tensor.dtype).removeprefix("torch.")) != want:
                raise ValueError(f"tensorwise send: tensor {i} is {name!r} {tuple(tensor.shape)}, expected {want}")
            broadcast(self.group, self.timeout, tensor)
            sent += tensor.numel() * tensor.element_size()
        return sent
