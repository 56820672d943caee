"""Tensors through vLLM's RPC channel: the engine's ``collective_rpc`` arguments and results.

vLLM's RPC channel (msgpack) returns tensors inside utility-call arguments and results as plain
[dtype, shape, data] lists, not tensors: ship them as explicit (dtype, shape, bytes) triples.
"""

from __future__ import annotations

import torch


def pack_tensor(t: torch.Tensor) -> list:
    t = t.detach().to("cpu").contiguous()
    return [str(t.dtype).removeprefix("torch."), list(t.shape), t.reshape(-1).view(torch.uint8).numpy().tobytes()]


def unpack_tensor(packed: list) -> torch.Tensor:
    dtype, shape, data = packed
    if not data:
        return torch.empty(shape, dtype=getattr(torch, dtype))
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(getattr(torch, dtype)).reshape(shape)
