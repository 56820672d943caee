"""Engine side of the fast weight-sync path: packed buckets copied straight into the parameters.

vLLM's own receive (``NCCLWeightTransferEngine.receive_weights``) allocates every bucket afresh and
hands its tensors to ``model.load_weights``, whose Python weight loaders map each trainer tensor
onto the engine's parameters (fused ``qkv_proj`` / ``gate_up_proj`` slices, vocabulary padding,
tensor-parallel shards) one copy at a time: ~25 ms for the 310 tensors of a 0.6B model, 7x the
broadcast itself. :class:`DirectReceiver` learns where every trainer tensor lands once and replays
that as one batched copy per bucket:

1. **Plan** (first update with a given layout). Each bucket is received and loaded tensor by
   tensor through ``load_weights`` while a ``TorchFunctionMode`` records every ``Tensor.copy_``.
   A trainer tensor is *planned* when all its copies read from the receive buffer (any view: a
   slice for a TP shard, a transpose) and, after the load, every destination equals its source.
   Anything else (a loader that converts, scales, writes by indexing, or copies nothing, such as a
   tied or skipped weight) stays on ``load_weights`` for that tensor, every time: the plan never
   guesses, it only replays what vLLM's loader was seen to do.
2. **Replay** (every later update). Broadcast a bucket into a persistent buffer, then
   ``torch._foreach_copy_(destinations, sources)`` and ``load_weights`` for the few unplanned
   tensors.

Buckets follow vLLM's packed wire format exactly (:func:`bucket_layout`); ``num_buffers`` buffers
rotate, each with its own CUDA stream, so a bucket's copies overlap the next one's broadcast and
buffer reuse is ordered by its stream. The whole receive runs between two engine steps (vLLM runs
utility calls on the engine-core thread), after a device synchronisation.

Valid only where loading is the whole story: weights that need post-processing after loading
(quantised models, e.g. online FP8) must use vLLM's layerwise reload.

No vLLM import: the broadcast and the loader come in as callables, so this runs on CPU in tests.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

import torch
from torch.overrides import TorchFunctionMode


def bucket_layout(sizes: Sequence[int], bucket_bytes: int) -> list[list[int]]:
    """Indices of the tensors in each packed bucket: a bucket takes tensors in order and closes
    right after the first one that brings its size past ``bucket_bytes`` (vLLM's
    ``pack_tensors`` / ``packed_nccl_broadcast_consumer`` rule; both sides must agree)."""
    buckets, current, total = [], [], 0
    for i, n in enumerate(sizes):
        current.append(i)
        total += n
        if total > bucket_bytes:
            buckets.append(current)
            current, total = [], 0
    if current:
        buckets.append(current)
    return buckets


@dataclass
class _Item:
    name: str
    offset: int  # bytes from the bucket's start
    nbytes: int
    dtype: torch.dtype
    shape: list[int]

    def view(self, buffer: torch.Tensor) -> torch.Tensor:
        raw = buffer[self.offset : self.offset + self.nbytes]
        if self.offset % self.dtype.itemsize:  # mixed dtypes misalign it: a copy (never planned)
            raw = raw.clone()
        return raw.view(self.dtype).view(self.shape)


@dataclass
class _Bucket:
    slot: int  # which rotating buffer
    size: int
    items: list[_Item]
    dsts: list[torch.Tensor] = field(default_factory=list)
    srcs: list[torch.Tensor] = field(default_factory=list)
    fallback: list[int] = field(default_factory=list)  # item indices loaded by load_weights


class _CopyRecorder(TorchFunctionMode):
    """Records ``dst.copy_(src)`` calls while one trainer tensor is loaded; ``foreign`` is set
    when a copy reads from outside the receive buffer or an indexed write happens."""

    def __init__(self, buffer: torch.Tensor):
        super().__init__()
        self.buffer_ptr = buffer.untyped_storage().data_ptr()
        self.copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.foreign = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.copy_:
            dst, src = args[0], args[1]
            if (
                isinstance(src, torch.Tensor)
                and src.untyped_storage().data_ptr() == self.buffer_ptr
                and src.dtype == dst.dtype
            ):
                self.copies.append((dst, src))
            else:
                self.foreign = True
        elif func is torch.Tensor.__setitem__:
            self.foreign = True
        return func(*args, **kwargs)


class DirectReceiver:
    """Receives packed weight updates into a model's parameters (see the module docstring).

    ``load_weights``: the engine model's ``load_weights(iterable of (name, tensor))``.
    ``fingerprint``: returns something that changes when the model's parameter storage is
    reallocated (e.g. the parameters' data pointers; vLLM's layerwise reload re-materialises
    layers); a changed fingerprint makes the next update plan afresh instead of copying into
    storage the model no longer uses.
    One receiver per worker; not thread-safe (the engine core calls it from one thread).
    """

    def __init__(
        self,
        load_weights: Callable[[Iterable[tuple[str, torch.Tensor]]], object],
        device: torch.device | str,
        fingerprint: Callable[[], object] | None = None,
    ):
        self.load_weights = load_weights
        self.fingerprint = fingerprint or (lambda: None)
        self._planned_for: object = None
        self.device = torch.device(device)
        self._plans: dict[tuple, list[_Bucket]] = {}
        self._buffers: list[torch.Tensor] = []
        self._streams: list[torch.cuda.Stream | None] = []
        self.last_stats: dict[str, float] = {}

    # ------------------------------------------------------------------ layout and buffers

    @staticmethod
    def _key(update_info: dict) -> tuple:
        return (
            tuple(update_info["names"]),
            tuple(update_info["dtype_names"]),
            tuple(tuple(s) for s in update_info["shapes"]),
            int(update_info["packed_buffer_size_bytes"]),
            int(update_info["packed_num_buffers"]),
        )

    def _layout(self, update_info: dict) -> list[_Bucket]:
        names, shapes = update_info["names"], update_info["shapes"]
        dtypes = [getattr(torch, d) for d in update_info["dtype_names"]]
        sizes = [math.prod(s) * d.itemsize for s, d in zip(shapes, dtypes)]
        nbuf = int(update_info["packed_num_buffers"])
        buckets = []
        for b, indices in enumerate(bucket_layout(sizes, int(update_info["packed_buffer_size_bytes"]))):
            items, offset = [], 0
            for i in indices:
                items.append(_Item(names[i], offset, sizes[i], dtypes[i], list(shapes[i])))
                offset += sizes[i]
            buckets.append(_Bucket(slot=b % nbuf, size=offset, items=items))
        return buckets

    def _ensure_buffers(self, buckets: list[_Bucket], nbuf: int) -> None:
        """Persistent buffers, one per slot, as large as the largest bucket they serve (vLLM's
        consumer allocates each bucket afresh; reusing keeps the allocator out of the hot path)."""
        need = [0] * nbuf
        for b in buckets:
            need[b.slot] = max(need[b.slot], b.size)
        if len(self._buffers) != nbuf or any(buf.numel() < n for buf, n in zip(self._buffers, need)):
            self._buffers = [torch.empty(n, dtype=torch.uint8, device=self.device) for n in need]
            self._plans.clear()  # planned source views point into the old buffers
        if len(self._streams) != nbuf:
            self._streams = [
                torch.cuda.Stream(self.device) if self.device.type == "cuda" else None for _ in range(nbuf)
            ]

    def _stream(self, slot: int):
        s = self._streams[slot]
        return torch.cuda.stream(s) if s is not None else contextlib.nullcontext()

    # ------------------------------------------------------------------ receive

    def receive(self, update_info: dict, broadcast: Callable[[torch.Tensor], None]) -> dict[str, float]:
        """Receive one update: ``broadcast(buffer)`` fills each bucket's buffer in order (the NCCL
        receive, enqueued on the current stream), then the bucket is loaded. Returns counts:
        ``planned`` / ``fallback`` tensors and whether this call built the plan (``planning``)."""
        key = self._key(update_info)
        fingerprint = self.fingerprint()
        if fingerprint != self._planned_for:
            self._plans.clear()
        buckets = self._plans.get(key)
        planning = buckets is None
        if planning:  # plans exist only for the current buffers, so only planning resizes them
            buckets = self._layout(update_info)
            self._ensure_buffers(buckets, int(update_info["packed_num_buffers"]))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # nothing of the last engine step still reads weights
        for bucket in buckets:
            buffer = self._buffers[bucket.slot][: bucket.size]
            with self._stream(bucket.slot):
                broadcast(buffer)
                if planning:
                    self._plan_bucket(bucket, buffer)
                else:
                    self._replay(bucket, buffer)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if planning:
            self._plans = {key: buckets}  # one layout at a time: a new one replaces the old
            self._planned_for = self.fingerprint()
        return self._stats(buckets, planning)

    def receive_in_place(self, update_info: dict, flat: torch.Tensor) -> dict[str, float]:
        """Receive one update whose buckets already lie back to back in ``flat`` (uint8, e.g. a
        trainer's buffer mapped over CUDA IPC): the planned copies read straight from it, no
        receive buffer. ``flat`` must stay the same tensor between updates (plans point into it)
        and hold every bucket (RuntimeError otherwise, before anything is copied). Returns the
        same counts as :meth:`receive`."""
        key = (self._key(update_info), flat.data_ptr())
        if self.fingerprint() != self._planned_for:
            self._plans.clear()
        buckets = self._plans.get(key)
        planning = buckets is None
        if planning:
            buckets = self._layout(update_info)
            needed = sum(b.size for b in buckets)
            if flat.numel() * flat.element_size() < needed:
                raise RuntimeError(
                    f"ipc receive: the trainer's buffer holds {flat.numel() * flat.element_size()} "
                    f"bytes, the update needs {needed}"
                )
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        offset = 0
        for bucket in buckets:
            view = flat[offset : offset + bucket.size]
            offset += bucket.size
            if planning:
                self._plan_bucket(bucket, view)
            else:
                self._replay(bucket, view)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if planning:
            self._plans = {key: buckets}
            self._planned_for = self.fingerprint()
        return self._stats(buckets, planning)

    def _replay(self, bucket: _Bucket, buffer: torch.Tensor) -> None:
        if bucket.dsts:
            torch._foreach_copy_(bucket.dsts, bucket.srcs)
        if bucket.fallback:
            self.load_weights([(bucket.items[i].name, bucket.items[i].view(buffer)) for i in bucket.fallback])

    def _stats(self, buckets: list[_Bucket], planning: bool) -> dict[str, float]:
        planned = sum(len(b.items) - len(b.fallback) for b in buckets)
        self.last_stats = dict(
            planned=planned,
            fallback=sum(len(b.fallback) for b in buckets),
            planning=float(planning),
            buckets=len(buckets),
        )
        return self.last_stats

    def _plan_bucket(self, bucket: _Bucket, buffer: torch.Tensor) -> None:
        """Load the bucket tensor by tensor under the recorder; keep the copies that replay it."""
        if buffer.is_cuda:
            torch.cuda.current_stream().synchronize()  # the loaders read the buffer on the host's order
        for i, item in enumerate(bucket.items):
            src_view = item.view(buffer)
            recorder = _CopyRecorder(buffer)
            with recorder:
                self.load_weights([(item.name, src_view)])
            copies = recorder.copies
            ok = (
                bool(copies)
                and not recorder.foreign
                and all(d.shape == s.shape and torch.equal(d, s) for d, s in copies)
            )
            if ok:
                for d, s in copies:
                    bucket.dsts.append(d)
                    bucket.srcs.append(s)
            else:
                bucket.fallback.append(i)
