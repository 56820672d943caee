"""A CUDA IPC buffer handle: how one process hands a GPU buffer to another on the same GPU.

The one piece of wire format that the `ipc` transport's sender (a trainer rank, which makes the
handle) and an engine's receiver (which opens it) share, so it lives in this leaf module (torch
only) that both import, instead of either importing the other.

The handle is ``{"uuid": the GPU's UUID, "args": pickled rebuild_cuda_tensor arguments}``. The
UUID check makes a mismatch an error: the two processes must really share the physical GPU (their
device indices may differ).
"""

from __future__ import annotations

import pickle

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor


def gpu_uuid(device: torch.device | int) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def buffer_handle(buffer: torch.Tensor) -> dict:
    """The handle of CUDA tensor `buffer` (made once: opening it maps the same memory)."""
    _, args = reduce_tensor(buffer)
    return {"uuid": gpu_uuid(buffer.device), "args": pickle.dumps(args)}


def open_handle(handle: dict, device: torch.device | int) -> torch.Tensor:
    """The sender's buffer, mapped into this process on `device` (the same physical GPU)."""
    index = (
        device
        if isinstance(device, int)
        else (device.index if device.index is not None else torch.cuda.current_device())
    )
    here = gpu_uuid(index)
    if handle["uuid"] != here:
        raise RuntimeError(
            f"ipc receive: the trainer's buffer is on GPU {handle['uuid']}, this engine on "
            f"{here}: colocated actors must share their GPU"
        )
    args = list(pickle.loads(handle["args"]))
    args[6] = index  # rebuild_cuda_tensor's device: the receiver's own index of that GPU
    return rebuild_cuda_tensor(*args)
