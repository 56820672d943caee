"""Prefill/decode disaggregation of the rollout group (`rollout.pd.*`).

With it on, the rollout group is two pools. The decode pool is the rollout actors as without it
(`rollout.num_actors` x `rollout.gpus_per_actor`, the engine's own tensor parallelism): they run
the episodes and take the driver's requests. The prefill pool is `prefill_actors` more actors of
the same engine that only compute prompts' KV caches; each generate call of a decode actor goes
to a prefill engine first (`actors.pd_router`), and the decode engine continues from the cache
handed over by `connector`.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlcore.config.bounds import bounded, choice

PD_CONNECTORS = ("object_store", "nixl")
"""Allowed `rollout.pd.connector` values: `object_store` (the transformers engine: the cache as
tensors through Ray's object store) and `nixl` (vLLM's NixlConnector: GPU to GPU)."""


@dataclass
class PDConfig:
    """Prefill/decode disaggregation (`rollout.pd.*`); off by default."""

    enabled: bool = False
    """Split the rollout group into a prefill pool and a decode pool (the rollout actors)."""
    prefill_actors: int = 1
    """Prefill engines (one actor each); the decode engines are `rollout.num_actors`."""
    prefill_cpus_per_actor: float = bounded(1.0, gt=0)
    """CPUs reserved in each prefill actor's bundle."""
    prefill_gpus_per_actor: float = bounded(0.0, ge=0)
    """GPUs reserved in each prefill actor's bundle (0 = CPU; vLLM: >= prefill_tensor_parallel_size,
    or a share below 1 to sit on a decode engine's GPU where the connector shares a device)."""
    prefill_tensor_parallel_size: int = bounded(1, ge=1)
    """Tensor parallelism of one prefill engine (engines with tensor parallelism only)."""
    connector: str = choice(*PD_CONNECTORS, default="object_store", noun="connector")
    """How the KV cache goes from prefill to decode engine: one of `PD_CONNECTORS` (the engine's
    registry line says which it supports: hf `object_store`, vllm `nixl`)."""
    prefill_timeout_s: float = bounded(60.0, gt=0)
    """Longest one prefill call may take; past it (or when its engine died) the router sends it
    to another prefill engine and keeps that one out for `retry_after_s`."""
    retry_after_s: float = bounded(5.0, gt=0)
    """How long the router skips a prefill engine that failed a call (died, froze, restarting)."""
