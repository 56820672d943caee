"""The `broadcast` transport: rlcore's own bucketed broadcast of the `SyncPlan` over a weight
group, into the engine's `apply_weights`. Its :class:`Receiver` is the transport's own, so every
engine can take it without a receiver of its own. On CPU it runs over gloo, on GPU over NCCL.

The weight group: trainer sender (rank 0) + one rank per rollout actor, apart from FSDP's group.
It is a stand-alone gloo (CPU) or NCCL (GPU) group built from its own TCPStore, so it never
touches the trainer's default process group; every operation waits with a timeout.
"""

from __future__ import annotations

import datetime
import time
from typing import TYPE_CHECKING, Callable, Iterable, Iterator

import torch
import torch.distributed as dist

from rlcore import weights_protocol
from rlcore.transfer import base
from rlcore.transfer.plan import (
    SyncPlan,
    empty_bucket_buffer,
    iter_buckets,
    unpack_bucket,
)

if TYPE_CHECKING:
    from rlcore.weights_protocol import ReceivingEngine, Seat, TransferOptions


class WeightGroup:
    def __init__(self, address: str, port: int, rank: int, world_size: int, timeout_s: float,
                 device: str = "cpu"):
        self.rank, self.world_size, self.device = rank, world_size, torch.device(device)
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.store = dist.TCPStore(address, port, world_size, is_master=(rank == 0), timeout=self.timeout)
        if self.device.type == "cuda":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = self.timeout
            self.pg = dist.ProcessGroupNCCL(self.store, rank, world_size, opts)
        else:
            self.pg = dist.ProcessGroupGloo(self.store, rank, world_size, self.timeout)

    def broadcast(self, tensor: torch.Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.timeout = self.timeout
        self.pg.broadcast([tensor], opts).wait(self.timeout)

    def send(self, plan: SyncPlan, named_tensors: Iterator[tuple[str, torch.Tensor]]) -> int:
        """Sender side: broadcast every bucket; returns bytes sent."""
        sent = 0
        for _, flat in iter_buckets(plan, named_tensors):
            self.broadcast(flat.to(self.device))
            sent += flat.numel() * flat.element_size()
        return sent

    def receive(self, plan: SyncPlan, keep: Callable[[str, torch.Tensor], None]) -> None:
        """Receiver side: receive every bucket and hand each named tensor to `keep`."""
        for bucket in plan.buckets:
            flat = empty_bucket_buffer(bucket, self.device)
            self.broadcast(flat)
            for name, view in unpack_bucket(bucket, flat):
                keep(name, view)


def receive_all(group: WeightGroup, plan: SyncPlan) -> Iterable[tuple[str, torch.Tensor]]:
    """All tensors of one sync, received before anything is applied (so an engine can swap them
    in under one short lock hold)."""
    received: list[tuple[str, torch.Tensor]] = []
    group.receive(plan, lambda name, t: received.append((name, t)))
    return received


class Sender(base.Sender):
    """Trainer rank 0: hosts the weight group and broadcasts every bucket of the plan."""

    def __init__(self, options: TransferOptions, plan: SyncPlan, device: str, address: str, port: int,
                 world_size: int):
        self.plan = plan
        self.group = WeightGroup(address, port, 0, world_size, options.timeout_s, device)

    def send(self, named: Iterator[tuple[str, torch.Tensor]]) -> int:
        return self.group.send(self.plan, named)


class Receiver(weights_protocol.Receiver):
    """One rank per rollout actor (on its GPU, or CPU); receives the whole sync, then swaps it into
    the engine (any engine: through `apply_weights`) under one short lock hold."""

    def __init__(self, seat: Seat, engine: ReceivingEngine):
        self.plan, self.engine = seat.layout, engine
        self.group = WeightGroup(seat.address, seat.port, seat.rank, seat.world_size, seat.options.timeout_s,
                                 seat.options.receive_device)

    def receive(self, version: int) -> dict[str, float]:
        start = time.perf_counter()
        tensors = receive_all(self.group, self.plan)
        received = time.perf_counter()
        self.engine.apply_weights(tensors, version)
        return {"sync_recv_s": received - start, "sync_apply_s": time.perf_counter() - received}
