"""The weight-sync protocol: which tensors travel in which bucket, and how a bucket is packed.

The trainer's sending rank and every engine agree on one `SyncPlan` before the first sync
(computed once from the trainer's parameter names, shapes and dtypes). Per sync, for each bucket
in order: the trainer ranks gather the bucket's full tensors (an FSDP collective), the sender
packs them into one flat buffer and broadcasts it on the weight group; each engine receives into
a buffer of the same size and unpacks it into named views. After the last bucket the engine
marks its weights as the new policy version. Transport is the actors' business (gloo on CPU,
NCCL or vLLM's weight-transfer engine on GPU); this module is pure.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator

import torch

_DTYPES = {
    "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
    "float64": torch.float64, "int64": torch.int64, "int32": torch.int32, "uint8": torch.uint8,
}


def dtype_of(name: str) -> torch.dtype:
    return _DTYPES[name]


@dataclass(frozen=True)
class TensorMeta:
    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * dtype_of(self.dtype).itemsize


@dataclass(frozen=True)
class Bucket:
    """Tensors of one dtype packed back to back in one flat buffer."""

    dtype: str
    metas: tuple[TensorMeta, ...]

    @property
    def numel(self) -> int:
        return sum(m.numel for m in self.metas)

    @property
    def nbytes(self) -> int:
        return sum(m.nbytes for m in self.metas)


@dataclass(frozen=True)
class SyncPlan:
    buckets: tuple[Bucket, ...]

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    @property
    def names(self) -> list[str]:
        return [m.name for b in self.buckets for m in b.metas]


def plan_buckets(metas: Iterable[TensorMeta], bucket_bytes: int) -> SyncPlan:
    """Group tensors, in the given order, into buckets of one dtype and at most `bucket_bytes`
    (a tensor larger than that travels alone). Order is kept so the sender can gather FSDP
    shards in the model's own parameter order."""
    buckets: list[Bucket] = []
    current: list[TensorMeta] = []
    size = 0
    for meta in metas:
        if current and (meta.dtype != current[0].dtype or size + meta.nbytes > bucket_bytes):
            buckets.append(Bucket(current[0].dtype, tuple(current)))
            current, size = [], 0
        current.append(meta)
        size += meta.nbytes
    if current:
        buckets.append(Bucket(current[0].dtype, tuple(current)))
    return SyncPlan(tuple(buckets))


def pack_bucket(bucket: Bucket, tensors: list[torch.Tensor]) -> torch.Tensor:
    """Flatten `tensors` (in bucket order, checked against the metadata) into one buffer."""
    if len(tensors) != len(bucket.metas):
        raise ValueError(f"weight sync: bucket holds {len(bucket.metas)} tensors, got {len(tensors)}")
    for meta, t in zip(bucket.metas, tensors):
        if tuple(t.shape) != meta.shape:
            raise ValueError(f"weight sync: {meta.name} has shape {tuple(t.shape)}, plan says {meta.shape}")
    dtype = dtype_of(bucket.dtype)
    return torch.cat([t.reshape(-1).to(dtype) for t in tensors])


def empty_bucket_buffer(bucket: Bucket, device: str | torch.device = "cpu") -> torch.Tensor:
    return torch.empty(bucket.numel, dtype=dtype_of(bucket.dtype), device=device)


def unpack_bucket(bucket: Bucket, flat: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """Named views into `flat` (no copies)."""
    offset = 0
    for meta in bucket.metas:
        yield meta.name, flat[offset:offset + meta.numel].view(meta.shape)
        offset += meta.numel


def iter_buckets(plan: SyncPlan, named_tensors: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[Bucket, torch.Tensor]]:
    """Consume (name, full tensor) pairs in plan order and yield each bucket's packed buffer
    as soon as its last tensor arrived, so only one bucket is materialised at a time."""
    for bucket in plan.buckets:
        tensors = []
        for meta in bucket.metas:
            name, tensor = next(named_tensors)
            if name != meta.name:
                raise ValueError(f"weight sync: expected {meta.name!r} next, got {name!r}")
            tensors.append(tensor)
        yield bucket, pack_bucket(bucket, tensors)
