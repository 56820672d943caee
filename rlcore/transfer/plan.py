"""The weight-sync plan: which tensors travel in which bucket, how a bucket is packed, and the
vLLM update info derived from the same plan.

The trainer's sending rank and every engine agree on one `SyncPlan` before the first sync
(computed once from the trainer's parameter names, shapes and dtypes). Per sync, for each bucket
in order: the trainer ranks gather the bucket's full tensors (an FSDP collective), the sender
packs them into one flat buffer and broadcasts it on the weight group; each engine receives into
a buffer of the same size and unpacks it into named views. After the last bucket the engine
marks its weights as the new policy version. The packed transports (`nccl`, `ipc`) describe the
same tensors to vLLM as an ``update_info`` (:func:`vllm_update_info`): names, wire dtype, shapes
and vLLM's own bucket size. The wires themselves are the transports' business
(`rlcore.transfer`); this module is pure.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import torch

_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "uint8": torch.uint8,
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
        yield meta.name, flat[offset : offset + meta.numel].view(meta.shape)
        offset += meta.numel


def iter_buckets(
    plan: SyncPlan, named_tensors: Iterator[tuple[str, torch.Tensor]]
) -> Iterator[tuple[Bucket, torch.Tensor]]:
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


# ---- the same plan as vLLM's packed `update_info` (the `nccl` and `ipc` transports)

WIRE_DTYPE = torch.bfloat16
"""The dtype of the packed (`nccl`, `ipc`) wire: vLLM engines serve in it."""
DEFAULT_BUCKET_BYTES = 512 * 1024 * 1024
"""Bucket size: large buckets run the broadcast near NVLink peak (345 GB/s at >= 1 GiB, 309 GB/s
at 64 MiB measured on nvidia-h200-x2); each side holds ``num_buffers`` of them at once."""
DEFAULT_NUM_BUFFERS = 2


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.bfloat16` -> `"bfloat16"` (the inverse of :func:`dtype_of` for the dtypes it knows)."""
    return str(dtype).removeprefix("torch.")


def _as_meta(item: Any) -> tuple[str, torch.dtype, tuple[int, ...]]:
    """(name, dtype, shape) from a (name, tensor) pair, a (name, dtype, shape) triple, or an object
    with ``name`` / ``dtype`` / ``shape`` (vLLM's ``ParamMeta``)."""
    if hasattr(item, "name") and hasattr(item, "dtype") and hasattr(item, "shape"):
        return item.name, item.dtype, tuple(item.shape)
    if len(item) == 2:
        name, tensor = item
        return name, tensor.dtype, tuple(tensor.shape)  # a DTensor reports its global shape
    name, dtype, shape = item
    return name, dtype, tuple(shape)


def update_info_for(
    metas: Iterable[Any], bucket_bytes: int = DEFAULT_BUCKET_BYTES, num_buffers: int = DEFAULT_NUM_BUFFERS
) -> dict:
    """The ``update_info`` an engine needs before the broadcast starts (vLLM's
    ``NCCLWeightTransferUpdateInfo`` as a plain dict): names, dtype names, shapes, packing.

    ``metas``: (name, tensor) pairs, (name, dtype, shape) triples or ``ParamMeta``-like objects,
    in send order, with the dtype the tensors will have on the wire.
    """
    names, dtype_names, shapes = [], [], []
    for item in metas:
        name, dtype, shape = _as_meta(item)
        names.append(name)
        dtype_names.append(dtype_name(dtype))
        shapes.append(list(shape))
    if not names:
        raise ValueError("update_info_for: no tensors")
    return dict(
        names=names,
        dtype_names=dtype_names,
        shapes=shapes,
        packed=True,
        packed_buffer_size_bytes=int(bucket_bytes),
        packed_num_buffers=int(num_buffers),
    )


def tensor_bytes(update_info: dict) -> list[int]:
    """Bytes of each tensor of the update described by ``update_info``, in order."""
    return [
        math.prod(s) * getattr(torch, d).itemsize for s, d in zip(update_info["shapes"], update_info["dtype_names"])
    ]


def update_info_bytes(update_info: dict) -> int:
    """Payload bytes of one update described by ``update_info``."""
    return sum(tensor_bytes(update_info))


def vllm_update_info(plan: SyncPlan, bucket_bytes: int) -> dict:
    """`plan`'s tensors, in plan order, in :data:`WIRE_DTYPE`, packed in buckets of
    `bucket_bytes`: what a vLLM engine is told before each `nccl` / `ipc` update."""
    metas = [(m.name, WIRE_DTYPE, m.shape) for b in plan.buckets for m in b.metas]
    return update_info_for(metas, bucket_bytes=int(bucket_bytes))
