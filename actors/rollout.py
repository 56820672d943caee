"""Rollout actor: an inference engine plus the environment's episode loop, served to the driver.

Threaded (several calls at once): `generate_groups` calls run while `pull_weights` receives a new
policy, which the engine swaps in between two decode steps.
"""

from __future__ import annotations

import time
import traceback

import torch

from actors.weight_group import WeightGroup, receive_all
from rlcore.config import RunConfig
from rlcore.engine.base import RolloutEngine, SamplingParams
from rlcore.envs import make_env
from rlcore.models.build import build_model, build_tokenizer
from rlcore.types import Group, Sample, Task
from rlcore.weight_sync import SyncPlan


def make_engine(cfg: RunConfig, tokenizer, seed: int) -> RolloutEngine:
    if cfg.rollout.engine == "hf":
        from rlcore.engine.hf_engine import HFEngine
        device = "cuda" if cfg.rollout.gpus_per_actor > 0 else "cpu"
        return HFEngine(build_model(cfg.model, tokenizer), tokenizer.pad_token_id, tokenizer.eos_token_id,
                        seed=seed, device=device)
    if cfg.rollout.engine == "vllm":
        from rlcore.engine.vllm_engine import VLLMEngine
        return VLLMEngine.from_config(cfg, seed=seed)
    raise ValueError(f"rollout.engine: unknown engine {cfg.rollout.engine!r}")


def failed_groups(tasks: list[Task], group_size: int, error: str) -> list[Group]:
    """Placeholder groups for a request that failed as a whole, so its samples are counted."""
    return [Group(task=t, samples=[Sample([], [], [], [], [], finish_reason="abort", failed=True, error=error)
                                   for _ in range(group_size)]) for t in tasks]


class RolloutWorker:
    def __init__(self, cfg: RunConfig, index: int):
        self.cfg, self.index = cfg, index
        torch.set_num_threads(max(1, int(cfg.rollout.cpus_per_actor)))
        self.tokenizer = build_tokenizer(cfg.model)
        self.engine = make_engine(cfg, self.tokenizer, seed=cfg.seed * 1000 + index)
        self.env = make_env(cfg.env.name, dict(cfg.env.args), cfg.env.seed)
        s = cfg.rollout.sampling
        self.params = SamplingParams(max_new_tokens=s.max_new_tokens, temperature=s.temperature, top_p=s.top_p)
        self.weight_group: WeightGroup | None = None
        self.plan: SyncPlan | None = None

    def ready(self) -> int:
        return self.index

    def init_weight_group(self, address: str, port: int, rank: int, world_size: int, plan: SyncPlan) -> bool:
        device = "cuda" if self.cfg.rollout.gpus_per_actor > 0 else "cpu"
        self.plan = plan
        self.weight_group = WeightGroup(address, port, rank, world_size,
                                        self.cfg.rollout.weight_sync_timeout_s, device)
        return True

    def pull_weights(self, version: int) -> dict:
        start = time.perf_counter()
        tensors = receive_all(self.weight_group, self.plan)
        received = time.perf_counter()
        self.engine.apply_weights(tensors, version)
        return {"sync_recv_s": received - start, "sync_apply_s": time.perf_counter() - received}

    def generate_groups(self, tasks: list[Task], group_size: int, split: str = "train") -> list[Group]:
        """Run `group_size` episodes per task. Never raises for an engine or reward fault: the
        samples come back marked failed, so the driver can count them."""
        try:
            return self.env.run_groups(tasks, group_size, self.engine, self.tokenizer, self.params)
        except Exception as exc:
            return failed_groups(tasks, group_size, f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=3)}")

    def policy_version(self) -> int:
        return self.engine.policy_version

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.engine.state_dict()
