"""The vLLM engine's own receivers (:meth:`VLLMEngine.receiver`): the transports whose receiving
end runs inside its workers.

- `nccl`: the engine's workers join the trainer's group, one rank each from the seat's rank
  (:meth:`WeightUpdates.init_weight_transfer`), and land every update in place
  (:meth:`WeightUpdates.receive_weights`).
- `ipc`: the engine lands the CUDA IPC buffer the seat's handle names, written by the trainer
  rank on its GPU (:meth:`ColocatedEngine.receive_ipc`).

Both read the seat's layout as vLLM's packed `update_info` (names, wire dtypes, shapes, bucket
size), the description the trainer's sender computed from the same plan.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from rlcore.weights.protocol import Receiver, Seat

if TYPE_CHECKING:
    from rlcore.engine.vllm.vllm_engine import VLLMEngine


def engine_timings(start: float, times: dict[str, float]) -> dict[str, float]:
    """A receive the engine ran itself: `sync_engine_s` (seconds since `start`) plus the engine's
    own timings, each prefixed `sync_`."""
    return {"sync_engine_s": time.perf_counter() - start, **{f"sync_{k}": v for k, v in times.items()}}


class NCCLReceiver(Receiver):
    """The engine's workers in the trainer's NCCL group; every update lands in place."""

    def __init__(self, seat: Seat, engine: VLLMEngine):
        self.engine, self.update_info, self.timeout_s = engine, seat.layout, seat.options.timeout_s
        engine.init_weight_transfer(seat.address, seat.port, seat.rank, seat.world_size, timeout_s=self.timeout_s)

    def receive(self, version: int) -> dict[str, float]:
        start = time.perf_counter()
        return engine_timings(start, self.engine.receive_weights(self.update_info, version, timeout_s=self.timeout_s))


class IPCReceiver(Receiver):
    """The engine on the trainer rank's GPU, landing that rank's IPC buffer. No group: the seat's
    rendezvous and ranks are unused."""

    def __init__(self, seat: Seat, engine: VLLMEngine):
        if seat.handle is None:
            raise ValueError("colocated weight receive needs the trainer rank's IPC handle")
        self.engine, self.update_info, self.handle = engine, seat.layout, seat.handle
        self.timeout_s = seat.options.timeout_s

    def receive(self, version: int) -> dict[str, float]:
        start = time.perf_counter()
        return engine_timings(
            start, self.engine.receive_ipc(self.update_info, self.handle, version, timeout_s=self.timeout_s)
        )


RECEIVERS: dict[str, Any] = {"nccl": NCCLReceiver, "ipc": IPCReceiver}
"""Transport name -> the engine's receiver class for it."""
