"""Rollout routing replay (R3): the experts an engine routed each token to travel with the sample
to the trainer, whose MoE blocks use them instead of their own top-k (`rlcore.trainer.moe`).

A sample's routing (``Sample.routed_experts``) is an integer array ``[rows, layers, top_k]``
(uint8 for at most 256 experts, else int16): row ``i`` holds the experts that token ``i`` of
``prompt_ids + completion_ids`` was sent to in each decoder layer (``layers`` is the model's
``num_hidden_layers``; rows of a dense layer in a mixed model are never read). An engine runs
every token through the model except the last sampled one (it is returned, never fed back), so
``rows = prompt + completion - 1``. That is what vLLM 0.26 returns in
``CompletionOutput.routed_experts`` with ``enable_return_routed_experts``: the prompt's rows when
the prefill completes, then one row per decode step (the token fed in), concatenated when the
request finishes (``v1/core/sched/scheduler.py``, ``v1/engine/output_processor.py``); the
transformers engine returns the same rows from hooks on its routers.

Packed into a micro-batch (:func:`packed_routing`) the rows become int16 ``[T, layers, top_k]``
aligned to input positions; ``-1`` (:data:`SELF_ROUTE`) marks a position the trainer routes
itself: each sample's last token, rows an engine did not return (a multi-turn episode's
environment tokens after the last policy turn), samples without routing (those the OpenAI-
compatible server assembles for verifiers environments carry none yet) and padding.

A vision-language sample's rows cover its image placeholder tokens like any prompt token: the
language model runs every position (the image's embeddings in the placeholders' places) and
routes it. The transformers engine hooks the language model's routers, so its prefill rows are
those of the expanded prompt; vLLM expands the one ``<|image_pad|>`` per image it is handed to
the same count (`rlcore.engine.vllm.vllm_engine`), captures every scheduled token of the
language model's MoE layers into that token's KV slot and returns ``num_prompt_tokens`` rows of
the expanded prompt on prefill (``v1/worker/gpu_model_runner.py``, ``v1/core/sched/scheduler.py``).

This module is torch-free apart from :func:`packed_routing` (imported lazily) and Ray-free.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import numpy as np

from rlcore.models.moe_family import family_names, moe_problem, num_routed_experts

if TYPE_CHECKING:
    import torch

    from rlcore.config import ModelConfig, RunConfig
    from rlcore.types import Sample

SELF_ROUTE = -1
"""Packed routing value of a (token, layer, slot) the trainer routes with its own top-k."""
OPTION = "routing_replay"
"""The engine-section option that turns replay on (`rollout.vllm.routing_replay`, `rollout.hf.routing_replay`)."""


def expert_dtype(num_experts: int) -> np.dtype:
    """The smallest integer type of an expert id: uint8 up to 256 experts, else int16."""
    return np.dtype(np.uint8) if num_experts <= 256 else np.dtype(np.int16)


def expected_rows(prompt_len: int, completion_len: int) -> int:
    """Rows an engine returns for a finished request: every token it ran through the model,
    i.e. ``prompt + completion - 1`` (the last sampled token is never fed back)."""
    return max(prompt_len + completion_len - 1, 0)


def aligned(routed: np.ndarray | None, num_tokens: int, layers: int, top_k: int) -> np.ndarray:
    """int16 ``[num_tokens, layers, top_k]``: the first rows of `routed` (at most `num_tokens`),
    :data:`SELF_ROUTE` elsewhere (and everywhere when `routed` is None)."""
    out = np.full((num_tokens, layers, top_k), SELF_ROUTE, dtype=np.int16)
    if routed is not None:
        r = np.asarray(routed)
        if r.ndim != 3 or r.shape[1:] != (layers, top_k):
            raise ValueError(f"routed experts of shape {tuple(r.shape)}; expected [rows, {layers}, {top_k}]")
        n = min(len(r), num_tokens)
        out[:n] = r[:n]
    return out


def routing_shape(samples: list[Sample]) -> tuple[int, int] | None:
    """(layers, top_k) of the first sample that carries routing; None when none does."""
    for s in samples:
        if s.routed_experts is not None:
            r = np.asarray(s.routed_experts)
            return int(r.shape[1]), int(r.shape[2])
    return None


def packed_routing(samples: list[Sample]) -> torch.Tensor | None:
    """The routing of a packed row of `samples` (in order): int16 ``[sum num_tokens, layers,
    top_k]`` (:func:`aligned` per sample); None when no sample carries routing."""
    shape = routing_shape(samples)
    if shape is None:
        return None
    import torch

    return torch.from_numpy(np.concatenate([aligned(s.routed_experts, s.num_tokens, *shape) for s in samples]))


def num_experts_of(model: ModelConfig) -> int | None:
    """Routed experts of the model (0: dense); None when unknown before it is built (a hub id)."""
    data = model_arch(model)
    return None if data is None else num_routed_experts(data)


def model_arch(model: ModelConfig) -> dict | None:
    """The model's config as a dict: `model.arch`, or a local `model.path`'s config.json; None
    for a hub id (known once the trainer builds it)."""
    if model.path is None:
        return dict(model.arch)
    config = os.path.join(str(model.path), "config.json")
    if os.path.isfile(config):
        import json

        with open(config) as f:
            return json.load(f)
    return None


def replay_enabled(options: Any) -> bool:
    """Whether an engine section (`rollout.vllm`, `rollout.hf`; None for an engine without one)
    asks for routing replay."""
    return bool(getattr(options, OPTION, False))


def routing_problems(cfg: RunConfig, section: str, options: Any) -> list[tuple[str, str]]:
    """Replay needs a mixture-of-experts policy (checked from `model.arch` or a local
    config.json; a hub model is checked when the trainer builds it) and RL mode."""
    if not replay_enabled(options):
        return []
    key = f"rollout.{section}.{OPTION}"
    experts = num_experts_of(cfg.model)
    if experts == 0:
        return [
            (
                key,
                "needs a mixture-of-experts model (a routed-expert count in model.arch: num_experts / "
                f"n_routed_experts / num_local_experts; families: {family_names()}); this model is dense",
            )
        ]
    arch = model_arch(cfg.model)
    problem = moe_problem(arch) if arch is not None else None
    if problem:
        return [(key, f"cannot replay this model's routing: {problem}")]
    if cfg.mode != "rl":
        return [(key, f"replays rollout routing in RL training; mode={cfg.mode!r} has no rollouts")]
    return []
