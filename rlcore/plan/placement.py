"""Placement: split (trainer ranks and engines on their own GPUs) or colocated (one trainer rank
and one engine share each GPU), resolved from the config and the GPUs present, before Ray starts.

Colocated layout: one placement group of `trainer.world_size` bundles `{CPU: cpus_per_rank +
cpus_per_actor, GPU: 1 - T}`; trainer rank i and rollout actor i both take half of bundle i's GPU
(`colocated_shares`), so Ray gives both the same device. T is the share of a GPU teacher
(on-policy distillation) that sits beside them in its own group, 0 without one. Weights then move over CUDA IPC
(`rlcore.transfer.ipc`), never NCCL between two processes on one GPU. Pure: no Ray, no CUDA.
"""

from __future__ import annotations

import copy

from rlcore.config import RunConfig
from rlcore.engine.registry import (
    COLOCATED_TRANSPORT,
    add_engine_kwargs,
    engine_spec,
    engines_where,
    memory_share,
    option_key,
    set_memory_share,
    sleep_level,
    tensor_parallel_size,
)
from rlcore.plan.memory import (
    colocated_engine_fraction,
    engine_min_bytes,
    memory_problems,
    planned_engine_kwargs,
)
from rlcore.plan.teacher import gpu_share

PLACEMENTS = ("auto", "colocated", "split")


def colocated_shares(cfg: RunConfig) -> tuple[float, float]:
    """(GPU of each colocated bundle, GPU of the trainer rank and of the engine in it): 1 - T and
    (1 - T) / 2, T = `rlcore.plan.teacher.gpu_share`. Ray's bookkeeping only; memory is planned by
    `rlcore.plan.memory`."""
    bundle = round(1.0 - gpu_share(cfg), 4)  # Ray counts resources in 1e-4 units
    return bundle, bundle / 2


def both_on_gpu(cfg: RunConfig) -> bool:
    """Whether an RL run has GPU trainer ranks and GPU engines (the only case placement matters)."""
    return cfg.mode == "rl" and cfg.trainer.gpus_per_rank > 0 and cfg.rollout.gpus_per_actor > 0


def colocatable(cfg: RunConfig) -> bool:
    """Whether the layout has the colocated shape: GPU trainer ranks and TP=1 engines, as many
    engines as ranks, at most one GPU each."""
    t, r = cfg.trainer, cfg.rollout
    return (
        both_on_gpu(cfg)
        and not r.pd.enabled
        and tensor_parallel_size(r) == 1
        and r.num_actors == t.world_size
        and t.gpus_per_rank <= 1
        and r.gpus_per_actor <= 1
    )


def resolve_placement(cfg: RunConfig, gpus: float) -> str:
    """`split` or `colocated`. `auto` is colocated when the layout has the colocated shape
    (`colocatable`) and either split placement needs more than `gpus` (world_size x
    gpus_per_rank + num_actors x gpus_per_actor) or a side asks a fraction of a GPU (it would
    share a device anyway); split otherwise. A config already planned keeps its decision."""
    if cfg.placed:
        return cfg.placed
    if cfg.placement != "auto":
        return cfg.placement
    if not colocatable(cfg):
        return "split"
    t, r = cfg.trainer, cfg.rollout
    need = t.world_size * t.gpus_per_rank + r.num_actors * r.gpus_per_actor + cfg.teacher.num_actors * gpu_share(cfg)
    return "colocated" if need > gpus or t.gpus_per_rank < 1 or r.gpus_per_actor < 1 else "split"


def resolve(cfg: RunConfig, gpus: float, gpu_bytes: int | None) -> RunConfig:
    """A copy of `cfg` with the plan's placement (`placed`) decided from the user's `placement`; colocated engines that take a GPU memory share
    (vLLM's `gpu_memory_utilization`) and were given none get the share the memory plan leaves
    beside the trainer; then the engine arguments the run implies that the user did not set
    (`rlcore.plan.memory.planned_engine_kwargs`: a colocated engine's cache budget, vLLM's
    CUDA-graph capture sizes)."""
    out = copy.deepcopy(cfg)
    out.placed = resolve_placement(cfg, gpus)
    takes_share = engine_spec(out.rollout.engine).memory_share_kwarg is not None
    if out.placed == "colocated" and takes_share and gpu_bytes and memory_share(out.rollout) is None:
        fraction = colocated_engine_fraction(out, gpu_bytes)
        need = engine_min_bytes(out)
        if fraction is not None and need is not None and fraction * gpu_bytes >= need:
            set_memory_share(out.rollout, fraction)
    planned = planned_engine_kwargs(out, gpu_bytes)
    if planned:  # only engines with `engine_kwargs` plan any
        add_engine_kwargs(out.rollout, planned)
    return out


def placement_problems(cfg: RunConfig, gpus: float, gpu_bytes: int | None, where: str) -> list[tuple[str, str]]:
    """Problems of a config whose placement is resolved (`resolve`): layouts colocation cannot
    serve, switches it does not support, and the memory plan. Split placement keeps its checks."""
    t, r = cfg.trainer, cfg.rollout
    out: list[tuple[str, str]] = []
    hook = engine_spec(r.engine).problems  # e.g. vLLM's whole GPUs per engine, or what colocation lacks
    if cfg.current_placement() == "split":
        out.extend(hook(cfg) if hook is not None else [])
        if sleep_level(r):
            out.append(
                (
                    option_key(r, "sleep_level"),
                    "sleep mode frees the GPU an engine shares with a trainer rank: it "
                    "needs placement=colocated (this run is split)",
                )
            )
        return out
    if cfg.mode != "rl":
        return [
            (
                "placement",
                f"colocated placement shares GPUs between trainer ranks and engines: it is for "
                f"mode=rl, got mode={cfg.mode}",
            )
        ]
    if t.gpus_per_rank <= 0 or r.gpus_per_actor <= 0:
        return [
            (
                "placement",
                f"colocated placement shares GPUs: needs trainer.gpus_per_rank > 0 and "
                f"rollout.gpus_per_actor > 0, got {t.gpus_per_rank:g} and {r.gpus_per_actor:g}",
            )
        ]
    out.extend(colocated_teacher_problems(cfg))
    if COLOCATED_TRANSPORT not in engine_spec(r.engine).transports:
        takes_it = engines_where(lambda s: COLOCATED_TRANSPORT in s.transports)
        out.append(
            (
                "rollout.engine",
                f"colocated placement needs rollout.engine="
                f"{takes_it} (weights over CUDA IPC into the engine), "
                f"got {r.engine!r}; use placement=split",
            )
        )
    if tensor_parallel_size(r) != 1:
        out.append(
            (
                option_key(r, "tensor_parallel_size"),
                f"colocated engines run with tensor_parallel_size=1 (one "
                f"engine beside each trainer rank), got {tensor_parallel_size(r)}; use placement=split",
            )
        )
    if r.num_actors != t.world_size:
        out.append(
            (
                "rollout.num_actors",
                f"colocated placement puts one engine beside each trainer rank: needs "
                f"rollout.num_actors = trainer.world_size = {t.world_size}, got {r.num_actors}",
            )
        )
    if t.gpus_per_rank > 1 or r.gpus_per_actor > 1:
        out.append(
            (
                "trainer.gpus_per_rank",
                f"colocated trainer ranks and engines share one GPU each: "
                f"gpus_per_rank and gpus_per_actor must be at most 1, got {t.gpus_per_rank:g} and "
                f"{r.gpus_per_actor:g}",
            )
        )
    if gpus < t.world_size:
        out.append(
            (
                "placement",
                f"colocated placement needs {t.world_size} GPU(s) (one per trainer rank); "
                f"{where} has {gpus:g}"
                + (
                    ""
                    if gpus
                    else f" (to plan for a GPU machine from here: dry_run=true "
                    f"cluster.nodes=1 cluster.gpus_per_node={t.world_size})"
                ),
            )
        )
    out.extend(hook(cfg) if hook is not None else [])  # e.g. vLLM's FP8 or layerwise reload
    if sleep_level(r):  # its values are checked by the engine's hook
        if cfg.algo.max_off_policy_steps != 0:
            out.append(
                (
                    option_key(r, "sleep_level"),
                    f"a sleeping engine cannot generate while the trainer steps: sleep "
                    f"mode needs algo.max_off_policy_steps=0, got {cfg.algo.max_off_policy_steps}",
                )
            )
        if cfg.eval.every_n_steps > 0:
            out.append(
                (
                    option_key(r, "sleep_level"),
                    "evaluation during training would reach a sleeping engine: set "
                    "eval.every_n_steps=0 with sleep mode",
                )
            )
    if not out and gpu_bytes:
        out.extend(memory_problems(cfg, gpu_bytes))
    return out


def colocated_teacher_problems(cfg: RunConfig) -> list[tuple[str, str]]:
    """A GPU teacher beside colocated trainer ranks and engines: an engine with a GPU memory share
    (vLLM's `gpu_memory_utilization`, planned with the others), a share below one GPU, at most one
    teacher per GPU. Its share and memory fraction themselves are checked in `rlcore.plan.teacher`."""
    t, share = cfg.teacher, gpu_share(cfg)
    if not share:
        return []
    out = []
    if engine_spec(t.engine).memory_share_kwarg is None:
        out.append(
            (
                "teacher.engine",
                f"a GPU teacher beside colocated trainer ranks and engines is planned by "
                f"its memory share: use teacher.engine="
                f"{engines_where(lambda s: s.memory_share_kwarg is not None)} or a CPU teacher "
                f"(teacher.gpus_per_actor=0), got {t.engine!r}",
            )
        )
    if share >= 1:
        out.append(
            (
                "teacher.gpus_per_actor",
                f"a colocated GPU teacher shares a GPU with a trainer rank and an "
                f"engine: give it a share below 1 (e.g. 0.2), got {share:g}; or use placement=split",
            )
        )
    if t.num_actors > cfg.trainer.world_size:
        out.append(
            (
                "teacher.num_actors",
                f"colocated placement fits one teacher per GPU beside the trainer "
                f"ranks: at most trainer.world_size = {cfg.trainer.world_size}, got {t.num_actors}",
            )
        )
    return out
