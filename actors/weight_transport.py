"""The weight transports (named in `rlcore.engine.registry`), trainer and engine side: the same
sync protocol over three wires. Which one a run uses is `registry.weight_transport(cfg)`.

- `broadcast`: our own weight group (`actors.weight_group`, gloo on CPU, NCCL on GPU) carrying
  the `rlcore.weight_sync` bucket plan; the engine swaps the received tensors in
  (`apply_weights`) between two decode steps.
- `nccl`: the engine's workers join the trainer's NCCL group and receive vLLM's packed buckets
  in place (`init_weight_transfer` / `receive_weights`), driven by `rlcore.engine.vllm_sync` on
  the trainer side.
- `ipc` (colocated placement, trainer rank i and engine i on one GPU): CUDA IPC
  (`rlcore.transfer.ipc`), every trainer rank a sender into its own engine (`receive_ipc`); no
  process group at all.

Ranks: the trainer's sending rank is 0; the rollout actor in slot j of the group takes
`ranks_per_actor` ranks from `1 + j * ranks_per_actor` (one per engine worker over `nccl`, one per
actor over `broadcast`). The group holds the actors that serve (`actors.membership`): slot j is
the j-th of them, so a group re-formed without a dead actor, or with a restarted one back,
renumbers its ranks.
"""

from __future__ import annotations

import time
from typing import Iterator

import torch

from actors.weight_group import WeightGroup, receive_all
from rlcore.config import RunConfig
from rlcore.engine.registry import tensor_parallel_size, weight_transport
from rlcore.engine.vllm_sync import init_sender, update_info_for
from rlcore.transfer.ipc import IPCSender
from rlcore.weight_sync import SyncPlan

VLLM_WIRE_DTYPE = torch.bfloat16  # the dtype of the packed (`nccl`, `ipc`) wire: vLLM engines serve in it


def ranks_per_actor(cfg: RunConfig) -> int:
    """Weight-group ranks of one rollout actor: each engine worker joins over `nccl`."""
    return tensor_parallel_size(cfg.rollout) if weight_transport(cfg) == "nccl" else 1


def world_size(cfg: RunConfig, engines: int | None = None) -> int:
    """Ranks of a weight group holding `engines` rollout actors (default: all of them)."""
    n = cfg.rollout.num_actors if engines is None else engines
    return 1 + n * ranks_per_actor(cfg)


def vllm_update_info(cfg: RunConfig, plan: SyncPlan) -> dict:
    metas = [(m.name, VLLM_WIRE_DTYPE, m.shape) for b in plan.buckets for m in b.metas]
    return update_info_for(metas, bucket_bytes=int(cfg.rollout.sync_bucket_mb * 2**20))


class TrainerSender:
    """Lives on trainer rank 0 (on every rank when colocated: each feeds the engine on its GPU)."""

    def __init__(self, cfg: RunConfig, address: str, port: int, plan: SyncPlan, device: str,
                 engines: int | None = None):
        self.cfg, self.plan = cfg, plan
        timeout = cfg.rollout.weight_sync_timeout_s
        self.ipc: IPCSender | None = None
        transport = weight_transport(cfg)
        if transport == "ipc":
            self.ipc = IPCSender(vllm_update_info(cfg, plan), device)
            self.vllm, self.group = None, None
        elif transport == "nccl":
            self.update_info = vllm_update_info(cfg, plan)
            self.vllm = init_sender(address, port, world_size(cfg, engines), timeout_s=timeout)
            self.group = None
        else:
            self.vllm = None
            self.group = WeightGroup(address, port, 0, world_size(cfg, engines), timeout, device)

    def send(self, named: Iterator[tuple[str, torch.Tensor]]) -> int:
        """Broadcast every parameter (colocated: write it into the IPC buffer); returns bytes sent."""
        if self.ipc is not None:
            return int(self.ipc.fill(named)["bytes"])  # the copy into the buffer converts to wire dtype
        if self.vllm is None:
            return self.group.send(self.plan, named)
        wire = ((n, t.to(VLLM_WIRE_DTYPE)) for n, t in named)
        info = self.vllm.send(wire, bucket_bytes=int(self.cfg.rollout.sync_bucket_mb * 2**20),
                              expect=self.update_info)
        return int(info["stats"]["bytes"])


class EngineReceiver:
    """Lives in a rollout actor, next to its engine."""

    def __init__(self, cfg: RunConfig, engine, slot: int, address: str, port: int, plan: SyncPlan,
                 handle: dict | None = None, engines: int | None = None):
        """`slot`: this actor's position among the group's `engines` actors (default: all)."""
        self.cfg, self.engine, self.plan, self.handle = cfg, engine, plan, handle
        timeout = cfg.rollout.weight_sync_timeout_s
        first_rank = 1 + slot * ranks_per_actor(cfg)
        transport = weight_transport(cfg)
        if transport == "ipc":
            if handle is None:
                raise ValueError("colocated weight receive needs the trainer rank's IPC handle")
            self.update_info = vllm_update_info(cfg, plan)
            self.group = None
        elif transport == "nccl":
            self.update_info = vllm_update_info(cfg, plan)
            engine.init_weight_transfer(address, port, first_rank, world_size(cfg, engines), timeout_s=timeout)
            self.group = None
        else:
            device = "cuda" if cfg.rollout.gpus_per_actor > 0 else "cpu"
            self.group = WeightGroup(address, port, first_rank, world_size(cfg, engines), timeout, device)

    def receive(self, version: int) -> dict[str, float]:
        start = time.perf_counter()
        if self.handle is not None:
            times = self.engine.receive_ipc(self.update_info, self.handle, version,
                                            timeout_s=self.cfg.rollout.weight_sync_timeout_s)
            return {"sync_engine_s": time.perf_counter() - start, **{f"sync_{k}": v for k, v in times.items()}}
        if self.group is None:
            times = self.engine.receive_weights(self.update_info, version,
                                                timeout_s=self.cfg.rollout.weight_sync_timeout_s)
            return {"sync_engine_s": time.perf_counter() - start, **{f"sync_{k}": v for k, v in times.items()}}
        tensors = receive_all(self.group, self.plan)
        received = time.perf_counter()
        self.engine.apply_weights(tensors, version)
        return {"sync_recv_s": received - start, "sync_apply_s": time.perf_counter() - received}
