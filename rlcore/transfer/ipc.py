"""The `ipc` transport: CUDA IPC, for a trainer rank and an engine that share one GPU (colocated
placement). NCCL never runs between two processes on one device.

:class:`Sender` (every trainer rank) fills an :class:`IPCSender` buffer. There is no receiver
here: the receiving end lives inside the engine (`Seat.handle` names the buffer, `Seat.layout`
is vLLM's packed `update_info` for it), so an engine that takes `ipc` returns its own receiver
from its `receiver` hook; the handle's format is `rlcore.weights.cuda_ipc`'s, which both sides import.

IPCSender (trainer rank): one persistent flat buffer holding every tensor of the sync in wire dtype,
back to back in the order of the update info (so vLLM's packed buckets are consecutive byte
ranges of it). Its CUDA IPC handle is made once and handed to the engine once, keyed by the
GPU's UUID. A sync copies the parameters into the buffer and waits for the copies.

Ordering: the sender fills and synchronises before the receiver reads; the receiver
synchronises before it returns, and the sender only writes again at the next sync. The driver
runs the two halves one after the other (`actors.weights.WeightSync`).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Iterable, Iterator

import torch

from rlcore.transfer import base
from rlcore.transfer.plan import SyncPlan, tensor_bytes, vllm_update_info
from rlcore.weights.cuda_ipc import buffer_handle

if TYPE_CHECKING:
    from rlcore.weights.protocol import TransferOptions


FILL_CHUNK_BYTES = 256 * 2**20
"""Wire bytes per multi-tensor copy of a fill (see `IPCSender.fill`)."""


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
            self.views.append(self.buffer[offset : offset + size].view(getattr(torch, dtype)).view(shape))
            offset += size
        self._handle = buffer_handle(self.buffer)

    def handle(self) -> dict:
        """What the receiver needs to open the buffer (`rlcore.weights.cuda_ipc.open_handle`)."""
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
                raise ValueError(
                    f"ipc send: tensor {i} is {name!r}, the engine expects "
                    f"{names[i] if i < len(names) else 'nothing more'!r}"
                )
            full = getattr(tensor, "full_tensor", None)
            tensor = full() if callable(full) else tensor
            if tuple(tensor.shape) != tuple(self.views[i].shape):
                raise ValueError(
                    f"ipc send: {name} has shape {tuple(tensor.shape)}, the engine expects {tuple(self.views[i].shape)}"
                )
            sources.append(tensor)
            pending += self.views[i].nbytes
            if pending >= FILL_CHUNK_BYTES:
                torch._foreach_copy_(self.views[first : i + 1], sources, non_blocking=True)
                first, pending, sources = i + 1, 0, []
        count = first + len(sources)
        if count != len(names):
            raise ValueError(f"ipc send: sent {count} tensors, the engine expects {len(names)}")
        if sources:
            torch._foreach_copy_(self.views[first:], sources, non_blocking=True)
        torch.cuda.synchronize(self.device)
        return {"bytes": float(self.nbytes), "fill_s": time.perf_counter() - start}


class Sender(base.Sender):
    """Every trainer rank: its IPC buffer, filled by `send` (the copy converts to wire dtype). No
    group: `address`, `port` and `world_size` are unused."""

    every_rank = True
    buffered = True

    def __init__(self, options: TransferOptions, plan: SyncPlan, device: str, address: str, port: int, world_size: int):
        self.ipc = IPCSender(vllm_update_info(plan, options.bucket_bytes), device)

    def send(self, named: Iterator[tuple[str, torch.Tensor]]) -> int:
        return int(self.ipc.fill(named)["bytes"])

    def handle(self) -> dict:
        """The buffer's handle (:meth:`IPCSender.handle`), for the engine on this GPU."""
        return self.ipc.handle()

    @classmethod
    def layout(cls, plan: SyncPlan, options: TransferOptions) -> dict:
        """vLLM's packed `update_info` of the buffer's contents (:func:`vllm_update_info`)."""
        return vllm_update_info(plan, options.bucket_bytes)
