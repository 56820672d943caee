"""The `nccl` transport: vLLM's packed NCCL broadcast, into engines whose workers join the group
themselves (vLLM's).

:class:`Sender` (trainer rank 0) drives the functions below. There is no receiver here: the
receiving end runs inside the engine's workers, so an engine that takes `nccl` returns its own
receiver from its `receiver` hook, built from its `Seat` (rendezvous, first rank, and
`Seat.layout`: the packed `update_info` of :meth:`Sender.layout`). Each engine worker takes one
rank of the group (the transport's `rank_per_worker`).

The group: the trainer's sending rank is rank 0 (it hosts the rendezvous store); engine workers
take ranks ``1 .. world_size - 1`` (each engine joins with its own first rank). The wire
format is vLLM's packed broadcast: tensors are flattened to bytes and concatenated into buckets of
``bucket_bytes`` (a bucket closes at the first tensor that takes it past the size), broadcast one
after another with ``num_buffers`` buckets in flight. The receiver rebuilds the same buckets from
:func:`rlcore.transfer.plan.update_info_for`, so the names, dtypes, shapes, order, bucket size and
buffer count must be identical on both sides: compute the update info once from the trainer's
parameter metadata (:func:`rlcore.transfer.plan.vllm_update_info`), hand it to the engines, and
send exactly those tensors in that order.

Timeouts. NCCL calls have none of their own and vLLM's packed producer synchronises its streams
without one, so every blocking step here runs in a watchdog thread joined with a deadline. On a
timeout the communicator is aborted (``ncclCommAbort``, which unblocks the stuck kernels), the
sender is marked broken and :class:`WeightSyncTimeout` is raised: a dead peer gives an error, never
a hang. Rebuild the group (new port) after that.

Multi-rank (FSDP2) trainers: materialising a sharded parameter (``DTensor.full_tensor()``) is a
collective, so every trainer rank must iterate the same parameters in the same order; only rank 0
calls :func:`send_weights`, the others call :func:`gather_only` on the same iterable.

vLLM is imported lazily (inside functions) so this module imports without it.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Sequence

import torch

from rlcore.transfer import base
from rlcore.transfer.plan import (
    DEFAULT_BUCKET_BYTES,
    DEFAULT_NUM_BUFFERS,
    WIRE_DTYPE,
    SyncPlan,
    dtype_name,
    update_info_bytes,
    update_info_for,
    vllm_update_info,
)

if TYPE_CHECKING:
    from rlcore.weights.protocol import TransferOptions


class WeightSyncTimeout(TimeoutError):
    """A weight-transfer step did not finish in time; the sender is unusable afterwards."""


def _run_with_deadline(
    fn: Callable[[], Any], timeout_s: float, what: str, on_timeout: Callable[[], None] | None = None
) -> Any:
    """Run ``fn`` in a daemon thread; return its result, re-raise its error, or call
    ``on_timeout`` and raise :class:`WeightSyncTimeout` after ``timeout_s``."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["result"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=target, name=f"rlcore-{what}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        if on_timeout is not None:
            on_timeout()
        raise WeightSyncTimeout(f"{what} did not finish within {timeout_s} s (peer dead or not joined?)")
    if "error" in box:
        raise box["error"]
    return box.get("result")


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """A full local tensor: ``DTensor.full_tensor()`` (an all-gather) or the tensor itself."""
    full = getattr(tensor, "full_tensor", None)
    return full() if callable(full) else tensor


@dataclass
class WeightSender:
    """Rank 0 of the weight-transfer group (a vLLM ``PyNcclCommunicator``)."""

    group: Any
    device: torch.device
    world_size: int
    timeout_s: float
    broken: str | None = None
    last_stats: dict = field(default_factory=dict)

    def abort(self, reason: str = "aborted") -> None:
        """Abort the communicator (unblocks stuck NCCL kernels) and mark the sender broken."""
        self.broken = reason
        destroy = getattr(self.group, "destroy", None)
        if callable(destroy):
            try:
                destroy()
            except Exception:  # noqa: BLE001 - best effort while tearing down a broken group
                pass

    def send(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        num_buffers: int = DEFAULT_NUM_BUFFERS,
        timeout_s: float | None = None,
        expect: dict | None = None,
    ) -> dict:
        """See :func:`send_weights`."""
        return send_weights(
            named_tensors, bucket_bytes, sender=self, num_buffers=num_buffers, timeout_s=timeout_s, expect=expect
        )


def init_sender(
    master_address: str,
    master_port: int,
    world_size: int,
    timeout_s: float = 300.0,
    device: torch.device | int | None = None,
) -> WeightSender:
    """Host the rendezvous as rank 0 and build the NCCL communicator with every engine worker
    (vLLM's ``NCCLWeightTransferEngine.trainer_init``). Blocks until all ``world_size`` members
    joined (the engines' receivers join at the same time), at most
    ``timeout_s``."""
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

    if device is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    else:
        dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())

    def init() -> Any:
        torch.cuda.set_device(dev)  # trainer_init binds the communicator to the current device
        return NCCLWeightTransferEngine.trainer_init(
            dict(master_address=master_address, master_port=int(master_port), world_size=int(world_size))
        )

    group = _run_with_deadline(init, timeout_s, "weight-transfer rendezvous")
    return WeightSender(group=group, device=dev, world_size=int(world_size), timeout_s=timeout_s)


def send_weights(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    *,
    sender: WeightSender,
    num_buffers: int = DEFAULT_NUM_BUFFERS,
    timeout_s: float | None = None,
    expect: dict | None = None,
) -> dict:
    """Broadcast ``named_tensors`` (CUDA tensors on the sender's device, in wire dtype; DTensors
    are gathered one at a time) to every engine as packed buckets, and wait until the last bucket
    left this GPU. Returns the ``update_info`` of what was sent (equal to the engines' copy when
    both came from the same metadata) with ``stats`` (seconds, bytes, GB/s) added.

    ``expect``: the update info the engines were given; a sequence of tensors is checked against
    it before anything is sent, a lazy iterable tensor by tensor (a mismatch then raises mid-way
    and the engines time out). Raises :class:`WeightSyncTimeout` after ``timeout_s`` (default: the
    sender's), aborting the communicator.
    """
    if sender.broken:
        raise WeightSyncTimeout(f"weight sender is unusable: {sender.broken}")
    from vllm.distributed.weight_transfer.nccl_engine import (
        NCCLTrainerSendWeightsArgs,
        NCCLWeightTransferEngine,
    )

    if expect is not None and isinstance(named_tensors, Sequence):
        got = update_info_for(named_tensors, bucket_bytes, num_buffers)
        _check_same(got, expect)
    recorded: list[tuple[str, torch.dtype, tuple[int, ...]]] = []

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for i, (name, tensor) in enumerate(named_tensors):
            tensor = _full(tensor)
            if tensor.device != sender.device:
                raise ValueError(f"send_weights: {name} is on {tensor.device}, the group on {sender.device}")
            meta = (name, tensor.dtype, tuple(tensor.shape))
            if expect is not None:
                want = (
                    (expect["names"][i], expect["dtype_names"][i], list(expect["shapes"][i]))
                    if i < len(expect["names"])
                    else None
                )
                if want != (name, dtype_name(tensor.dtype), list(tensor.shape)):
                    raise ValueError(f"send_weights: tensor {i} is {meta}, the engines expect {want}")
            recorded.append(meta)
            yield name, tensor

    # vLLM packs on its own streams, which do not wait for the caller's: the step's kernels
    # (optimizer update) must be done before the first bucket is packed.
    step_done = torch.cuda.Event()
    step_done.record(torch.cuda.current_stream(sender.device))

    def send() -> None:
        torch.cuda.set_device(sender.device)
        step_done.synchronize()
        args = NCCLTrainerSendWeightsArgs(
            group=sender.group,
            src=0,
            packed=True,
            packed_buffer_size_bytes=int(bucket_bytes),
            packed_num_buffers=int(num_buffers),
        )
        NCCLWeightTransferEngine.trainer_send_weights(tensors(), args)
        # The producer returns with the last buckets still in flight on its streams.
        torch.cuda.synchronize(sender.device)

    timeout = sender.timeout_s if timeout_s is None else timeout_s
    start = time.perf_counter()
    _run_with_deadline(
        send, timeout, "weight broadcast", on_timeout=lambda: sender.abort(f"broadcast timed out after {timeout} s")
    )
    seconds = time.perf_counter() - start
    info = update_info_for(recorded, bucket_bytes, num_buffers)
    if expect is not None and len(recorded) != len(expect["names"]):
        raise ValueError(f"send_weights: sent {len(recorded)} tensors, the engines expect {len(expect['names'])}")
    nbytes = update_info_bytes(info)
    info["stats"] = dict(send_s=seconds, bytes=nbytes, send_gbps=nbytes / seconds / 1e9)
    sender.last_stats = info["stats"]
    return info


def gather_only(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Non-sending trainer ranks: run the same per-parameter gathers as the sender (so the FSDP
    collectives line up) and drop the results. Returns the number of tensors."""
    n = 0
    for _, tensor in named_tensors:
        _full(tensor)
        n += 1
    return n


def _check_same(got: dict, expect: dict) -> None:
    for key in ("names", "dtype_names", "shapes", "packed_buffer_size_bytes", "packed_num_buffers"):
        if got[key] != expect[key]:
            if isinstance(got[key], list):
                for i, (a, b) in enumerate(zip(got[key], expect[key])):
                    if a != b:
                        raise ValueError(f"send_weights: {key}[{i}] is {a!r}, the engines expect {b!r}")
                raise ValueError(f"send_weights: {len(got[key])} {key}, the engines expect {len(expect[key])}")
            raise ValueError(f"send_weights: {key} is {got[key]!r}, the engines expect {expect[key]!r}")


class Sender(base.Sender):
    """Trainer rank 0: hosts the group and broadcasts every update in :data:`WIRE_DTYPE`, checked
    against the update info the engines were given."""

    def __init__(self, options: TransferOptions, plan: SyncPlan, device: str, address: str, port: int, world_size: int):
        self.bucket_bytes = options.bucket_bytes
        self.update_info = vllm_update_info(plan, options.bucket_bytes)
        self.vllm = init_sender(address, port, world_size, timeout_s=options.timeout_s)

    def send(self, named: Iterator[tuple[str, torch.Tensor]]) -> int:
        wire = ((n, t.to(WIRE_DTYPE)) for n, t in named)
        info = self.vllm.send(wire, bucket_bytes=self.bucket_bytes, expect=self.update_info)
        return int(info["stats"]["bytes"])

    @classmethod
    def layout(cls, plan: SyncPlan, options: TransferOptions) -> dict:
        """vLLM's packed `update_info` of every update (:func:`vllm_update_info`)."""
        return vllm_update_info(plan, options.bucket_bytes)
