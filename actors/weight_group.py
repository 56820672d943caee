"""The weight-sync process group: trainer sender (rank 0) + every engine, apart from FSDP's group.

It is a stand-alone gloo (CPU) or NCCL (GPU) group built from its own TCPStore, so it never
touches the trainer's default process group; every operation waits with a timeout.
"""

from __future__ import annotations

import datetime
from typing import Callable, Iterable, Iterator

import torch
import torch.distributed as dist

from rlcore.weight_sync import SyncPlan, empty_bucket_buffer, iter_buckets, unpack_bucket


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
