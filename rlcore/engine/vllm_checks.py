"""Config checks of the vLLM engine (its registry hook), torch-free: they run before Ray starts."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rlcore.config import RunConfig


def vllm_problems(cfg: RunConfig) -> list[tuple[str, str]]:
    """Each engine runs on `tensor_parallel_size` whole GPUs under split placement; colocated
    (or `auto`) engines take a share of one GPU, which `rlcore.placement.placement_problems`
    checks once the placement is resolved."""
    r = cfg.rollout
    if r.gpus_per_actor < r.tensor_parallel_size and (cfg.placement == "split" or r.gpus_per_actor <= 0):
        return [("rollout.gpus_per_actor", f"the vllm engine needs tensor_parallel_size "
                 f"({r.tensor_parallel_size}) GPUs per actor, got {r.gpus_per_actor}")]
    return []
