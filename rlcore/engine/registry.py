"""Engine plug-ins: one table maps an engine name to everything the rest of rlcore asks about it.

Validation (`rlcore.validate`), placement (`rlcore.placement`), the plan (`rlcore.plan`), the
rollout and teacher actors and the weight transport (`actors/`) read an engine's
:class:`EngineSpec` and never branch on its name. The class is named by its import path, so this
module (and validation) stays free of torch: the class is imported only where an engine is built.

Adding an engine (SGLang, say): write a :class:`rlcore.engine.base.RolloutEngine` in its own
module or folder, and add one :class:`EngineSpec` line to ``_BUILT_IN`` below (a test or an
out-of-tree plug-in may call :func:`register_engine` instead).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from rlcore.engine.vllm_checks import vllm_problems

if TYPE_CHECKING:
    from rlcore.config import RolloutConfig, RunConfig
    from rlcore.engine.base import RolloutEngine

TRANSPORTS = ("broadcast", "nccl", "ipc")
"""Weight transports (see :mod:`rlcore.engine.base`): `broadcast` (rlcore's bucketed broadcast,
gloo on CPU / NCCL on GPU, into `apply_weights`), `nccl` (the engine's workers join the
trainer's NCCL group), `ipc` (CUDA IPC from the trainer rank on the same GPU)."""


@dataclass(frozen=True)
class EngineSpec:
    """What rlcore needs to know about one engine, before and after building it."""

    name: str
    """The `rollout.engine` / `teacher.engine` value."""
    cls: str
    """`module:Class` of its :class:`RolloutEngine` (imported only where an engine is built)."""
    options: tuple[str, ...] = ()
    """Its config section: the `rollout.*` keys it reads beyond the ones every engine reads."""
    transports: tuple[str, ...] = ("broadcast",)
    """Weight transports it receives; split placement uses the first that is not `ipc`, and
    colocated placement needs `ipc`."""
    needs_gpu: bool = False
    """It runs on GPUs only (tensor_parallel_size GPUs per actor)."""
    sleeps: bool = False
    """It has a sleep mode (`rollout.sleep_level`)."""
    quantizations: tuple[str, ...] = ()
    """The online weight quantizations it serves (`rollout.quantization`)."""
    memory_share_kwarg: str | None = None
    """The `engine_kwargs` key of its GPU memory share (colocated placement and a teacher on a
    share of a GPU set it); None: the engine takes no such share."""
    problems: Callable[[RunConfig], list[tuple[str, str]]] | None = None
    """Its own config checks (run by `rlcore.validate`), as (key, message) pairs."""


_BUILT_IN = (
    EngineSpec("hf", "rlcore.engine.hf_engine:HFEngine"),
    EngineSpec("vllm", "rlcore.engine.vllm_engine:VLLMEngine",
               options=("tensor_parallel_size", "weight_reload", "kv_on_update", "engine_kwargs", "quantization",
                        "sleep_level"),
               transports=("nccl", "ipc"), needs_gpu=True, sleeps=True, quantizations=("fp8",),
               memory_share_kwarg="gpu_memory_utilization", problems=vllm_problems),
)
_ENGINES: dict[str, EngineSpec] = {spec.name: spec for spec in _BUILT_IN}


def register_engine(spec: EngineSpec) -> EngineSpec:
    """Add (or replace) an engine by name; returns `spec`."""
    unknown = [t for t in spec.transports if t not in TRANSPORTS]
    if unknown or not spec.transports:
        raise ValueError(f"engine {spec.name!r}: transports must be some of {list(TRANSPORTS)}, got {list(spec.transports)}")
    _ENGINES[spec.name] = spec
    return spec


def engine_names() -> list[str]:
    return list(_ENGINES)


def engine_spec(name: str) -> EngineSpec:
    """The spec of engine `name`; KeyError naming the known engines otherwise."""
    spec = _ENGINES.get(name)
    if spec is None:
        raise KeyError(f"unknown engine {name!r}; choose one of {engine_names()}")
    return spec


def engines_where(test: Callable[[EngineSpec], bool]) -> str:
    """Names of the engines passing `test`, joined for a message (`vllm`, `a|b`)."""
    return "|".join(s.name for s in _ENGINES.values() if test(s))


def engine_class(name: str) -> type[RolloutEngine]:
    module, _, attr = engine_spec(name).cls.partition(":")
    return getattr(importlib.import_module(module), attr)


def make_engine(cfg: RunConfig, tokenizer: Any, seed: int) -> RolloutEngine:
    """Build `cfg.rollout.engine` for `cfg.model` (:meth:`RolloutEngine.from_config`)."""
    return engine_class(cfg.rollout.engine).from_config(cfg, seed=seed, tokenizer=tokenizer)


def weight_transport(cfg: RunConfig) -> str:
    """The transport a run's weights take to its engines: `ipc` when colocated (validation
    checked the engine takes it), else the engine's first other transport."""
    if cfg.placement == "colocated":
        return "ipc"
    return next(t for t in engine_spec(cfg.rollout.engine).transports if t != "ipc")


def tensor_parallel_size(r: RolloutConfig) -> int:
    """Workers of one engine: `tensor_parallel_size` for engines that read it, else 1."""
    return r.tensor_parallel_size if "tensor_parallel_size" in engine_spec(r.engine).options else 1


def min_gpus_per_actor(r: RolloutConfig) -> int:
    """GPUs one actor of a GPU-only engine needs (one per worker); 0 for engines that also run on CPU."""
    return tensor_parallel_size(r) if engine_spec(r.engine).needs_gpu else 0


def engine_problems(cfg: RunConfig) -> list[tuple[str, str]]:
    """`rollout.engine` is registered, the switches it lacks are off, and its own checks pass."""
    r = cfg.rollout
    if r.engine not in _ENGINES:
        return [("rollout.engine", f"unknown engine {r.engine!r}; choose one of {engine_names()}")]
    spec, out = engine_spec(r.engine), []
    if r.sleep_level in (1, 2) and not spec.sleeps:
        out.append(("rollout.sleep_level", f"sleep mode needs an engine that has one: rollout.engine="
                    f"{engines_where(lambda s: s.sleeps)}, got {r.engine!r}"))
    known = {q for s in _ENGINES.values() for q in s.quantizations}
    if r.quantization is not None and r.quantization in known and r.quantization not in spec.quantizations:
        out.append(("rollout.quantization", f"{r.quantization.upper()} rollout needs rollout.engine="
                    f"{engines_where(lambda s: r.quantization in s.quantizations)}, got {r.engine!r}"))
    if spec.problems is not None:
        out.extend(spec.problems(cfg))
    return out


def quantizations() -> tuple[str, ...]:
    """Every online quantization some engine serves."""
    return tuple(dict.fromkeys(q for s in _ENGINES.values() for q in s.quantizations))
