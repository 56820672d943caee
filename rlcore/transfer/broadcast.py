"""The `broadcast` transport: rlcore's own bucketed broadcast of the `SyncPlan` over a weight
group, into the engine's `apply_weights`. Its :class:`Receiver` is the transport's own, so every
engine can take it without a receiver of its own. On CPU it runs over gloo, on GPU over NCCL.

The weight group: trainer sender (rank 0) + one rank per rollout actor, apart from FSDP's group.
It is a stand-alone gloo (CPU) or NCCL (GPU) group built from its own TCPStore, so it never
touches the trainer's default process group.

Every wait ends by its deadline (`TransferOptions.timeout_s`) or sooner, when whoever gave up on
the operation (the driver, on seeing a member die or freeze) calls :func:`abort` on the group's
rendezvous: the rendezvous and each CPU bucket wait in short polls that read the store's abort
key, so a member that died before it joined, or froze in the middle of a sync, holds the others
for the driver's detection time, not the whole timeout. A group given up is kept (not destroyed)
until its own operations end: gloo's destructor joins the threads still in the broken
collective, which would block its caller for the rest of the timeout.
"""

from __future__ import annotations

import datetime
import time
from typing import TYPE_CHECKING, Callable, Iterable, Iterator

import torch
import torch.distributed as dist

from rlcore.transfer import base
from rlcore.transfer.plan import (
    SyncPlan,
    empty_bucket_buffer,
    iter_buckets,
    unpack_bucket,
)
from rlcore.weights import protocol as weights_protocol

if TYPE_CHECKING:
    from rlcore.weights.protocol import ReceivingEngine, Seat, TransferOptions


ABORT_KEY = "rlcore/abort"
JOINED_KEY = "rlcore/joined"
CHECK_S = 0.05
"""How often a waiting member reads the abort key (a store round trip)."""
_GIVEN_UP: list[tuple[object, ...]] = []
"""Groups given up with an operation still in flight: (work or None, process group, store)."""


class WeightGroupAborted(RuntimeError):
    """An operation of the weight group was given up (its abort key was set, or it passed its
    deadline); the group is unusable: form a new one (new port)."""


def abort(address: str, port: int, timeout_s: float = 2.0) -> bool:
    """Tell every member of the group at `address:port` to give up what it waits for (each
    raises :class:`WeightGroupAborted` within `CHECK_S`). Returns False when the rendezvous
    store does not answer within `timeout_s` (its host is gone: nothing waits on it)."""
    try:
        store = dist.TCPStore(
            address, port, None, is_master=False, timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False
        )
        store.set(ABORT_KEY, b"1")
        return True
    except (RuntimeError, dist.DistStoreError):
        return False


def _bury() -> None:
    """Drop the groups given up whose operations have ended (their destructors no longer block)."""
    _GIVEN_UP[:] = [g for g in _GIVEN_UP if g[0] is not None and not g[0].is_completed()]


class WeightGroup:
    def __init__(self, address: str, port: int, rank: int, world_size: int, timeout_s: float, device: str = "cpu"):
        self.rank, self.world_size, self.device = rank, world_size, torch.device(device)
        self.timeout_s, self.timeout = timeout_s, datetime.timedelta(seconds=timeout_s)
        _bury()
        self.pg = None
        self.store = dist.TCPStore(
            address, port, world_size, is_master=(rank == 0), timeout=self.timeout, wait_for_workers=False
        )
        self._rendezvous()
        if self.device.type == "cuda":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = self.timeout
            self.pg = dist.ProcessGroupNCCL(self.store, rank, world_size, opts)
        else:
            self.pg = dist.ProcessGroupGloo(self.store, rank, world_size, self.timeout)

    def _rendezvous(self) -> None:
        """Every member counts itself in, then waits until all have (or the group is given up):
        the process group is built only once every member is known to be there."""
        deadline = time.monotonic() + self.timeout_s
        self.store.add(JOINED_KEY, 1)
        while self.store.add(JOINED_KEY, 0) < self.world_size:
            self._check(deadline, f"weight group rendezvous ({self.world_size} members)")
            time.sleep(CHECK_S)

    def _check(self, deadline: float, what: str, work=None) -> None:
        given_up = self.store.check([ABORT_KEY])
        if given_up or time.monotonic() >= deadline:
            _GIVEN_UP.append((work, self.pg, self.store))
            raise WeightGroupAborted(
                f"{what}: given up by the driver (a member died or froze)"
                if given_up
                else f"{what} did not finish within {self.timeout_s:g}s"
            )

    def broadcast(self, tensor: torch.Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.timeout = self.timeout
        work = self.pg.broadcast([tensor], opts)
        if self.device.type == "cuda":  # NCCL: the wait orders the stream; its own timeout aborts a stuck kernel
            work.wait(self.timeout)
            return
        deadline, next_check, pause = time.monotonic() + self.timeout_s, time.monotonic() + CHECK_S, 1e-4
        while not work.is_completed():
            if time.monotonic() >= next_check:
                self._check(deadline, "weight broadcast", work)
                next_check = time.monotonic() + CHECK_S
            time.sleep(pause)
            pause = min(pause * 2, 0.01)
        work.wait()  # raises the error the collective ended with (a peer's socket closed)

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

    def __init__(self, options: TransferOptions, plan: SyncPlan, device: str, address: str, port: int, world_size: int):
        self.plan = plan
        self.group = WeightGroup(address, port, 0, world_size, options.timeout_s, device)

    def send(self, named: Iterator[tuple[str, torch.Tensor]]) -> int:
        return self.group.send(self.plan, named)

    @classmethod
    def abort(cls, address: str, port: int) -> bool:
        return abort(address, port)


class Receiver(weights_protocol.Receiver):
    """One rank per rollout actor (on its GPU, or CPU); receives the whole sync, then swaps it into
    the engine (any engine: through `apply_weights`) under one short lock hold."""

    def __init__(self, seat: Seat, engine: ReceivingEngine):
        self.plan, self.engine = seat.layout, engine
        self.group = WeightGroup(
            seat.address, seat.port, seat.rank, seat.world_size, seat.options.timeout_s, seat.options.receive_device
        )

    def receive(self, version: int) -> dict[str, float]:
        start = time.perf_counter()
        tensors = receive_all(self.group, self.plan)
        received = time.perf_counter()
        self.engine.apply_weights(tensors, version)
        return {"sync_recv_s": received - start, "sync_apply_s": time.perf_counter() - received}
