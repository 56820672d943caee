"""Trainer rank actor: a thin Ray wrapper around `rlcore.trainer.core.TrainerCore`."""

from __future__ import annotations

import os
import time

import ray
import torch

from actors.weight_group import WeightGroup
from rlcore.config import RunConfig
from rlcore.packing import MicroBatch
from rlcore.trainer.core import TrainerCore, free_port
from rlcore.weight_sync import SyncPlan


class TrainerRank:
    """One FSDP2 rank. Every method that runs collectives must be called on all ranks at once."""

    def __init__(self, cfg: RunConfig, rank: int, world_size: int):
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.device = "cuda" if cfg.trainer.gpus_per_rank > 0 else "cpu"
        torch.set_num_threads(max(1, int(cfg.trainer.cpus_per_rank)))
        self.core: TrainerCore | None = None
        self.weight_group: WeightGroup | None = None

    def address(self) -> tuple[str, int]:
        """Where this rank can host a rendezvous (called on rank 0)."""
        return ray.util.get_node_ip_address(), free_port()

    def init_distributed(self, master_addr: str, master_port: int) -> bool:
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = master_addr, str(master_port)
        if self.device == "cuda":
            torch.cuda.set_device(0)  # Ray exposes exactly this rank's GPU as device 0
        self.core = TrainerCore(self.cfg, self.rank, self.world_size, device=self.device)
        return True

    def parameter_metas(self) -> list[tuple[str, tuple[int, ...], str]]:
        return self.core.parameter_metas()

    def init_weight_group(self, address: str, port: int, world_size: int) -> bool:
        if self.rank == 0:
            self.weight_group = WeightGroup(address, port, 0, world_size,
                                            self.cfg.rollout.weight_sync_timeout_s, self.device)
        return True

    def train_step(self, micro_batches: list[MicroBatch], normalizer: float) -> dict:
        result = self.core.train_step(micro_batches, normalizer)
        return {**result.metrics, "version": result.version}

    def push_weights(self, plan: SyncPlan) -> dict:
        """Gather full parameters (all ranks) and broadcast them from rank 0, bucket by bucket."""
        start = time.perf_counter()
        params = self.core.full_parameters()
        sent = 0
        if self.rank == 0:
            sent = self.weight_group.send(plan, params)
        else:
            for _ in params:  # take part in the FSDP all-gathers only
                pass
        return {"sync_bytes": sent, "sync_send_s": time.perf_counter() - start}

    def full_state(self) -> dict[str, torch.Tensor]:
        """Full parameters on CPU (collective; for tests and checks)."""
        return {n: t.cpu().clone() for n, t in self.core.full_parameters()}

    def shutdown(self) -> None:
        if self.core:
            self.core.shutdown()
