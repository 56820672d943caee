"""The `ipc` transport: CUDA IPC, for a trainer rank and an engine that share one GPU (colocated
placement). NCCL never runs between two processes on one device.

:class:`Sender` (every trainer rank) fills an :class:`IPCSender` buffer; :class:`Receiver` (the
rollout actor on the same GPU) has the engine land it (:meth:`RolloutEngine.receive_ipc`, whose
vLLM workers use an :class:`IPCReceiver`).

IPCSender (trainer rank): one persistent flat buffer holding every tensor of the sync in wire dtype,
back to back in the order of the update info (so vLLM's packed buckets are consecutive byte
ranges of it). Its CUDA IPC handle is made once (`reduce_tensor`) and handed to the engine once,
keyed by the GPU's UUID. A sync copies the parameters into the buffer and waits for the copies.

IPCReceiver (vLLM worker): opens the handle once, on the worker's device (the UUID must match: the
two processes really share the GPU), and lands each bucket straight in the engine's parameters
with :meth:`rlcore.engine.vllm.direct_receive.DirectReceiver.receive_in_place` (vLLM's loader recorded
once, replayed as batched device copies), between two engine steps.

Ordering: the sender fills and synchronises before the receiver reads; the receiver
synchronises before it returns, and the sender only writes again at the next sync. The driver
runs the two halves one after the other (`actors.colocation`).
"""

from __future__ import annotations

import pickle
import time
from typing import TYPE_CHECKING, Iterable, Iterator

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from rlcore.transfer import base
from rlcore.transfer.plan import (
    SyncPlan,
    tensor_bytes,
    update_info_bytes,
    vllm_update_info,
)

if TYPE_CHECKING:
    from rlcore.config import RunConfig
    from rlcore.engine.base import RolloutEngine


FILL_CHUNK_BYTES = 256 * 2**20
"""Wire bytes per multi-tensor copy of a fill (see `IPCSender.fill`)."""


def gpu_uuid(device: torch.device | int) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


class IPCSender:
    """Trainer side: the flat buffer and its handle (see the module docstring)."""

    def __init__(self, update_info: dict, device: torch.device | str):
        self.update_info = update_info
        self.device = torch.device(device)
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        sizes = tensor_bytes(update_info)
        self.nbytes = sum(sizes)
        self.buffer = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)
        self.views: list[torch.Tensor] = []
        offset = 0
        for size, dtype, shape in zip(sizes, update_info["dtype_names"], update_info["shapes"]):
            self.views.append(self.buffer[offset:offset + size].view(getattr(torch, dtype)).view(shape))
            offset += size
        _, args = reduce_tensor(self.buffer)
        self._handle = {"uuid": gpu_uuid(self.device), "args": pickle.dumps(args)}

    def handle(self) -> dict:
        """What the receiver needs to open the buffer: {"uuid": GPU UUID, "args": pickled
        `rebuild_cuda_tensor` arguments}."""
        return dict(self._handle)

    def fill(self, named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, float]:
        """Copy every tensor (converted to wire dtype) into the buffer, in the update's order,
        then wait for the copies. Raises ValueError on a name or shape the receiver does not
        expect. Returns bytes and seconds.

        The copies go out as multi-tensor launches (`torch._foreach_copy_`, which casts) of up to
        `FILL_CHUNK_BYTES` each: a copy per tensor cost a kernel launch and a Python round each,
        most of the fill's time for a model of a few hundred small tensors, and the chunk bounds
        how many gathered full tensors (several ranks) are alive at once."""
        start = time.perf_counter()
        names = self.update_info["names"]
        sources: list[torch.Tensor] = []
        first, pending = 0, 0  # the chunk being gathered: tensors first.. of the update, its bytes
        for i, (name, tensor) in enumerate(named):
            if i >= len(names) or names[i] != name:
                raise ValueError(f"ipc send: tensor {i} is {name!r}, the engine expects "
                                 f"{names[i] if i < len(names) else 'nothing more'!r}")
            full = getattr(tensor, "full_tensor", None)
            tensor = full() if callable(full) else tensor
            if tuple(tensor.shape) != tuple(self.views[i].shape):
                raise ValueError(f"ipc send: {name} has shape {tuple(tensor.shape)}, the engine expects "
                                 f"{tuple(self.views[i].shape)}")
            sources.append(tensor)
            pending += self.views[i].nbytes
            if pending >= FILL_CHUNK_BYTES:
                torch._foreach_copy_(self.views[first:i + 1], sources, non_blocking=True)
                first, pending, sources = i + 1, 0, []
        count = first + len(sources)
        if count != len(names):
            raise ValueError(f"ipc send: sent {count} tensors, the engine expects {len(names)}")
        if sources:
            torch._foreach_copy_(self.views[first:], sources, non_blocking=True)
        torch.cuda.synchronize(self.device)
        return {"bytes": float(self.nbytes), "fill_s": time.perf_counter() - start}


def open_handle(handle: dict, device: torch.device | int) -> torch.Tensor:
    """The sender's flat buffer, mapped into this process on `device` (same physical GPU)."""
    index = device if isinstance(device, int) else (device.index if device.index is not None
                                                    else torch.cuda.current_device())
    here = gpu_uuid(index)
    if handle["uuid"] != here:
        raise RuntimeError(f"ipc receive: the trainer's buffer is on GPU {handle['uuid']}, this engine on "
                           f"{here}: colocated actors must share their GPU")
    args = list(pickle.loads(handle["args"]))
    args[6] = index  # rebuild_cuda_tensor's device: the receiver's own index of that GPU
    return rebuild_cuda_tensor(*args)


class IPCReceiver:
    """Engine-worker side: the opened buffer plus the direct receive into the model."""

    def __init__(self, direct_receiver, device: torch.device):
        self.direct = direct_receiver
        self.device = device
        self._opened: tuple[bytes, torch.Tensor] | None = None

    def receive(self, update_info: dict, handle: dict) -> dict[str, float]:
        if self._opened is None or self._opened[0] != handle["args"]:
            self._opened = (handle["args"], open_handle(handle, self.device))
        flat = self._opened[1]
        needed = update_info_bytes(update_info)
        if flat.numel() < needed:
            raise RuntimeError(f"ipc receive: the trainer's buffer holds {flat.numel()} bytes, the update "
                               f"needs {needed}")
        return self.direct.receive_in_place(update_info, flat)


class Sender(base.Sender):
    """Every trainer rank: its IPC buffer, filled by `send` (the copy converts to wire dtype). No
    group: `address`, `port` and `world_size` are unused."""

    every_rank = True
    buffered = True

    def __init__(self, cfg: RunConfig, plan: SyncPlan, device: str, address: str, port: int,
                 world_size: int):
        self.ipc = IPCSender(vllm_update_info(cfg, plan), device)

    def send(self, named: Iterator[tuple[str, torch.Tensor]]) -> int:
        return int(self.ipc.fill(named)["bytes"])

    def handle(self) -> dict:
        """The buffer's handle (:meth:`IPCSender.handle`), for the engine on this GPU."""
        return self.ipc.handle()


class Receiver(base.Receiver):
    """The rollout actor on the sender's GPU: its engine lands the buffer `handle` names. No group:
    `address`, `port`, `rank` and `world_size` are unused."""

    def __init__(self, cfg: RunConfig, plan: SyncPlan, engine: RolloutEngine, address: str, port: int,
                 rank: int, world_size: int, handle: dict | None = None):
        if handle is None:
            raise ValueError("colocated weight receive needs the trainer rank's IPC handle")
        self.cfg, self.engine, self.handle = cfg, engine, handle
        self.update_info = vllm_update_info(cfg, plan)

    def receive(self, version: int) -> dict[str, float]:
        start = time.perf_counter()
        times = self.engine.receive_ipc(self.update_info, self.handle, version,
                                        timeout_s=self.cfg.rollout.weight_sync_timeout_s)
        return base.engine_timings(start, times)
