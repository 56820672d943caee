"""What a vLLM engine does when it shares its GPU with a trainer rank (colocated placement):
receive weights over CUDA IPC (the `ipc` transport; its receiver is
:class:`rlcore.engine.vllm.vllm_receivers.IPCReceiver`) and sleep while the trainer steps.

Mixed into :class:`rlcore.engine.vllm.vllm_engine.VLLMEngine` (it uses that class's loop plumbing:
``_call``, ``_rpc``, ``_swap``, ``_needs_pause``); the worker half is
:meth:`RLCoreWorkerExtension.rlcore_receive_ipc`.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import torch

from rlcore.engine.base import WeightSyncError
from rlcore.engine.vllm.direct_receive import DirectReceiver
from rlcore.weights.cuda_ipc import open_handle


class WorkerIPCReceiver:
    """Engine-worker side of the `ipc` transport: the trainer's buffer, opened once on the
    worker's device (the GPU's UUID must match the handle's: the two processes really share the
    GPU), and each update landed straight in the parameters with
    :meth:`DirectReceiver.receive_in_place` (vLLM's loader recorded once, replayed as batched
    device copies), between two engine steps."""

    def __init__(self, direct_receiver: DirectReceiver, device: torch.device):
        self.direct = direct_receiver
        self.device = device
        self._opened: tuple[bytes, torch.Tensor] | None = None

    def receive(self, update_info: dict, handle: dict) -> dict[str, float]:
        if self._opened is None or self._opened[0] != handle["args"]:
            self._opened = (handle["args"], open_handle(handle, self.device))
        return self.direct.receive_in_place(update_info, self._opened[1])


def receive_ipc_on_worker(worker: Any, update_info: dict, handle: dict) -> dict:
    """Worker side: open the trainer's buffer once and land the update in the parameters
    (:class:`WorkerIPCReceiver` over a :class:`rlcore.engine.vllm.direct_receive.DirectReceiver`).
    Returns the worker's seconds and counts."""
    start = time.perf_counter()
    receiver = getattr(worker, "_rlcore_ipc_receiver", None)
    if receiver is None:
        model = worker._rlcore_model()
        device = next(p for p in model.parameters() if p.device.type == "cuda").device
        direct = DirectReceiver(
            model.load_weights, device, fingerprint=lambda: tuple(p.data_ptr() for p in model.parameters())
        )
        receiver = worker._rlcore_ipc_receiver = WorkerIPCReceiver(direct, device)
    stats = receiver.receive(update_info, handle)
    return {**stats, "worker_s": time.perf_counter() - start}


class ColocatedEngine:
    """IPC receive, sleep and wake for :class:`VLLMEngine` (see the module docstring)."""

    def receive_ipc(
        self, update_info: dict, handle: dict, version: int, timeout_s: float | None = None
    ) -> dict[str, float]:
        """Land the update the trainer rank on this GPU just wrote into its IPC buffer and serve
        it as policy ``version``: between two engine steps, with no pause unless caches must be
        cleared. Raises ``WeightSyncError`` (engine then unusable) on failure or timeout."""
        self._check()

        async def body() -> dict[str, float]:
            t = time.perf_counter()
            workers = await self._rpc("rlcore_receive_ipc", update_info=update_info, handle=handle)
            return {
                "update_s": time.perf_counter() - t,
                "worker_s": max(w["worker_s"] for w in workers),
                "fallback_tensors": float(max(w["fallback"] for w in workers)),
            }

        timeout = timeout_s or self.rpc_timeout_s
        try:
            return self._call(
                asyncio.wait_for(self._swap(version, body, pause=self._needs_pause()), timeout),
                timeout + 10,
                "receive_ipc",
            )
        except Exception as exc:
            self._broken = f"receive_ipc failed: {type(exc).__name__}: {exc}"
            raise WeightSyncError(self._broken) from exc

    def sleep(self, level: int) -> float:
        """Free the engine's GPU memory (vLLM sleep mode; the engine must be built with
        ``enable_sleep_mode=True``): level 1 offloads weights to CPU, level 2 drops them (the
        next sync refills them). Requests queued stay queued. Returns seconds."""
        t = time.perf_counter()
        self._call(self._llm.sleep(level=level, mode="keep"), self.rpc_timeout_s, "sleep")
        return time.perf_counter() - t

    def wake_up(self) -> float:
        """Take the memory back (weights of a level-2 sleep are garbage until the next sync) and
        resume scheduling. Returns seconds."""
        t = time.perf_counter()
        self._call(self._llm.wake_up(), self.rpc_timeout_s, "wake_up")
        return time.perf_counter() - t
