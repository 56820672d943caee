"""Engine plug-ins: one table maps an engine name to everything the rest of rlcore asks about it.

Validation (`rlcore.plan.validate`), placement (`rlcore.plan.placement`), the plan (`rlcore.plan.layout`) and the
rollout and teacher actors (`actors/`) read an engine's :class:`EngineSpec` and never branch on
its name. The weight transports never read it: the actors pass them the transport's name
(:func:`weight_transport`) and the engine's worker count (:func:`tensor_parallel_size`). The class is named by its import path, so this
module (and validation) stays free of torch: the class is imported only where an engine is built.

Each engine reads its options from its own config section (`rollout.vllm.*`, `rollout.hf.*`, and
the same under `teacher.*`): the spec names the section's attribute and dataclass, and the
helpers below (`engine_options`, `option`, `tensor_parallel_size`, `sleep_level`, `memory_share`,
`memory_budget`) let the rest of rlcore ask the selected engine's section without knowing which
engine it is.

Adding an engine (SGLang, say): write a :class:`rlcore.engine.base.RolloutEngine` (and its
options dataclass) in its own module or folder, and add one :class:`EngineSpec` line to
``_BUILT_IN`` below (a test or an out-of-tree plug-in calls :func:`register_engine` instead).
vllm's and hf's sections are fields of `RolloutConfig` / `TeacherConfig`; a plug-in's section is
declared by :func:`register_engine` in :mod:`rlcore.config.plugins` (no class is changed). Over
`broadcast` that is all: the transport's own receiver lands weights through `apply_weights`. For
a transport whose receiving end runs inside the engine (`nccl`, `ipc`, or one of its own wire
registered with the transfer package's `register_transport`), the engine also returns its
receiver from `RolloutEngine.receiver`, in its own folder (vLLM's: `rlcore/engine/vllm/`).
"""

from __future__ import annotations

import importlib
import tempfile
from dataclasses import dataclass, fields, is_dataclass
from typing import TYPE_CHECKING, Any, Callable

from rlcore.batch.routing import routing_problems
from rlcore.config import RolloutConfig
from rlcore.config.engines import HFOptions, VLLMOptions
from rlcore.config.plugins import add_plugin_section, remove_plugin_section
from rlcore.config.teacher import TeacherConfig
from rlcore.engine.vllm.vllm_checks import vllm_problems
from rlcore.engine.vllm.vllm_plan import planned_kwargs as vllm_planned_kwargs

if TYPE_CHECKING:
    from rlcore.config import RunConfig
    from rlcore.engine.base import RolloutEngine

COLOCATED_TRANSPORT = "ipc"
"""The transport of colocated placement (trainer rank and engine on one GPU); split placement
never uses it."""


@dataclass(frozen=True)
class EngineSpec:
    """What rlcore needs to know about one engine, before and after building it."""

    name: str
    """The `rollout.engine` / `teacher.engine` value."""
    cls: str
    """`module:Class` of its :class:`RolloutEngine` (imported only where an engine is built)."""
    section: str | None = None
    """Attribute of its config section under `rollout` and `teacher` (`vllm` -> `rollout.vllm.*`);
    None: the engine reads no options of its own."""
    options: type | None = None
    """Dataclass of its section (one-line docstring per field); its engine reads it from
    `cfg.rollout.<section>` (:func:`engine_options`)."""
    transports: tuple[str, ...] = ("broadcast",)
    """Weight transports it receives (names in the transfer package's `PAIRS`; validation checks
    they are registered); split placement uses the first that is not :data:`COLOCATED_TRANSPORT`,
    and colocated placement needs that one. For each that has no receiver of its own the engine
    returns its receiver from `RolloutEngine.receiver`."""
    needs_gpu: bool = False
    """It runs on GPUs only (`tensor_parallel_size` GPUs per actor)."""
    memory_share_kwarg: str | None = None
    """The key of its section's `engine_kwargs` that holds its GPU memory share (colocated
    placement and a teacher on a share of a GPU set it); None: the engine takes no such share."""
    memory_budget_kwarg: str | None = None
    """The key of its section's `engine_kwargs` that fixes its cache's bytes (vLLM's
    `kv_cache_memory_bytes`): with it set, the engine sizes nothing from the memory free at its
    start, so a colocated trainer rank starts and warms up beside it (the plan sets it from the
    engine's share: `rlcore.plan.memory.colocated_cache_bytes`); None: it has no such key."""
    planned_kwargs: Callable[[Any, int], dict[str, Any]] | None = None
    """`engine_kwargs` it derives from the run, given its section and the most sequences one engine
    holds at once (vLLM: its CUDA-graph capture sizes); keys the user set are never replaced."""
    rollout_only: tuple[str, ...] = ()
    """Options of its section that only a rollout engine reads (a teacher never receives
    weights nor sleeps): a teacher's section must leave them at their defaults."""
    problems: Callable[[RunConfig], list[tuple[str, str]]] | None = None
    """Its own config checks (run by `rlcore.plan.validate`), as (key, message) pairs."""
    scores_top_k: bool = False
    """It implements `RolloutEngine.score_top_k_batch` (a teacher with `teacher.top_k` > 0)."""
    traced_elsewhere: bool = False
    """Its work runs in processes of its own (vLLM's engine core): when the run records steps
    (`profile.steps`) its `from_config` gets `profile_dir` (a folder on its node its processes
    write their traces to) and `profile_with_stack`, and it overrides `RolloutEngine.start_profile`
    and `stop_profile`; False: the default records the actor's own process."""
    pd_connectors: tuple[str, ...] = ()
    """KV-cache connectors it disaggregates prefill and decode over (`rollout.pd.connector`,
    `rlcore.config.pd.PD_CONNECTORS`); its class then implements `RolloutEngine.prefill` and
    `generate(..., prefilled=)`. Empty: no disaggregation."""
    pd_needs_role: bool = False
    """Its `from_config` takes `pd_role` and `pd_connector` (its engine is configured per pool:
    vLLM's `kv_transfer_config`); False: any of its engines prefills and decodes."""
    prestart: str | None = None
    """`module:function`, called with its section by the engine's actor first thing, before the
    actor's tokenizer and the engine's build (vLLM: starts the server its engine core is forked
    from, `rlcore.engine.vllm.warm_core`); None: nothing to start early."""


_BUILT_IN = (
    EngineSpec(
        "hf",
        "rlcore.engine.hf_engine:HFEngine",
        section="hf",
        options=HFOptions,
        rollout_only=("routing_replay",),
        scores_top_k=True,
        pd_connectors=("object_store",),
    ),
    EngineSpec(
        "vllm",
        "rlcore.engine.vllm.vllm_engine:VLLMEngine",
        section="vllm",
        options=VLLMOptions,
        transports=("nccl", "ipc"),
        needs_gpu=True,
        memory_share_kwarg="gpu_memory_utilization",
        memory_budget_kwarg="kv_cache_memory_bytes",
        planned_kwargs=vllm_planned_kwargs,
        rollout_only=(
            "weight_reload",
            "kv_on_update",
            "quantization",
            "sleep_level",
            "routing_replay",
            "sampling_kwargs",
            "kv_offload_gb",
        ),
        problems=vllm_problems,
        pd_connectors=("nixl",),
        pd_needs_role=True,
        prestart="rlcore.engine.vllm.warm_core:prestart",
        traced_elsewhere=True,
    ),
)
_ENGINES: dict[str, EngineSpec] = {}


def register_engine(spec: EngineSpec) -> EngineSpec:
    """Add (or replace) an engine by name; returns `spec`. An engine with a section new to the
    schema gets it under `rollout.<section>` and `teacher.<section>` (settable from YAML and the
    command line like the built-in ones)."""
    if not spec.transports or not all(isinstance(t, str) and t for t in spec.transports):
        raise ValueError(f"engine {spec.name!r}: transports must be transport names, got {list(spec.transports)}")
    if (spec.section is None) != (spec.options is None) or (
        spec.options is not None and not is_dataclass(spec.options)
    ):
        raise ValueError(f"engine {spec.name!r}: section and options go together, options a dataclass")
    if spec.section is not None:
        for holder in (RolloutConfig, TeacherConfig):
            declared = {f.name: f.default_factory for f in fields(holder)}
            if declared.get(spec.section, spec.options) is not spec.options:
                raise ValueError(f"engine {spec.name!r}: {holder.__name__}.{spec.section} is already another key")
        if spec.section not in {f.name for f in fields(RolloutConfig)}:
            try:
                add_plugin_section(spec.section, spec.options)
            except ValueError as exc:
                raise ValueError(f"engine {spec.name!r}: {exc}") from None
    _ENGINES[spec.name] = spec
    return spec


def unregister_engine(name: str) -> None:
    """Remove a registered engine and its config section (a test's or a plug-in's own
    clean-up: a section left in the schema is carried, and pickled, by every later config)."""
    spec = _ENGINES.pop(name, None)
    if spec is not None and spec.section is not None and spec.section not in {s.section for s in _ENGINES.values()}:
        remove_plugin_section(spec.section)


for _spec in _BUILT_IN:
    register_engine(_spec)


def engine_names() -> list[str]:
    return list(_ENGINES)


def sections() -> dict[str, tuple[str, type]]:
    """Engine name -> (section attribute, options dataclass), for the engines that have one."""
    return {s.name: (s.section, s.options) for s in _ENGINES.values() if s.section is not None}


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


def make_engine(cfg: RunConfig, tokenizer: Any, seed: int, pd_role: str | None = None) -> RolloutEngine:
    """Build `cfg.rollout.engine` for `cfg.model` from its own section
    (:meth:`RolloutEngine.from_config`), on CUDA when `rollout.gpus_per_actor` > 0. `pd_role`
    (`prefill` / `decode`, prefill/decode disaggregation): passed on with the connector
    (`rollout.pd.connector`) to an engine that needs to know (vLLM's KV transfer config)."""
    r = cfg.rollout
    extra: dict[str, Any] = {}
    if pd_role is not None and engine_spec(r.engine).pd_needs_role:
        extra = {"pd_role": pd_role, "pd_connector": r.pd.connector}
    if cfg.profile.steps and engine_spec(r.engine).traced_elsewhere:
        extra.update(
            {"profile_dir": tempfile.mkdtemp(prefix="rlcore-profile-"), "profile_with_stack": cfg.profile.with_stack}
        )
    return engine_class(r.engine).from_config(
        engine_options(r),
        cfg.model,
        seed=seed,
        tokenizer=tokenizer,
        device="cuda" if r.gpus_per_actor > 0 else "cpu",
        **extra,
    )


def prestart_engine(group: RolloutConfig | TeacherConfig) -> None:
    """Start what `group.engine` starts early in its actor (:attr:`EngineSpec.prestart`), when
    the group runs on GPUs; nothing for an engine without it."""
    spec = engine_spec(group.engine)
    if spec.prestart is None or group.gpus_per_actor <= 0:
        return
    module, _, name = spec.prestart.partition(":")
    getattr(importlib.import_module(module), name)(engine_options(group))


def weight_transport(cfg: RunConfig) -> str:
    """The transport a run's weights take to its engines: `ipc` when colocated (validation
    checked the engine takes it), else the engine's first other transport."""
    if cfg.current_placement() == "colocated":
        return COLOCATED_TRANSPORT
    return next(t for t in engine_spec(cfg.rollout.engine).transports if t != COLOCATED_TRANSPORT)


def engine_options(group: RolloutConfig | TeacherConfig) -> Any:
    """The section of `group.engine` (`group.vllm` for vllm); None for an engine without one."""
    spec = engine_spec(group.engine)
    return getattr(group, spec.section) if spec.section is not None else None


def option(group: RolloutConfig | TeacherConfig, name: str, default: Any = None) -> Any:
    """Option `name` of the selected engine's section, `default` where it has no such option
    (e.g. `sleep_level` 0 for an engine without a sleep mode)."""
    return getattr(engine_options(group), name, default)


def has_option(group: RolloutConfig | TeacherConfig, name: str) -> bool:
    """Whether the selected engine's section has option `name` (e.g. a sleep mode's `sleep_level`)."""
    return hasattr(engine_options(group), name)


def option_key(group: RolloutConfig | TeacherConfig, name: str, prefix: str = "rollout") -> str:
    """The dotted key of the selected engine's option `name` (`rollout.vllm.sleep_level`)."""
    return f"{prefix}.{engine_spec(group.engine).section}.{name}"


def tensor_parallel_size(group: RolloutConfig | TeacherConfig) -> int:
    """Workers of one engine: its section's `tensor_parallel_size`, 1 for engines without one."""
    return option(group, "tensor_parallel_size", 1)


def sleep_level(r: RolloutConfig) -> int:
    """The rollout engine's sleep level (0 = resident; engines without a sleep mode: 0)."""
    return option(r, "sleep_level", 0)


def quantization(r: RolloutConfig) -> str | None:
    """The rollout engine's online weight quantization (None: unquantized or no such option)."""
    return option(r, "quantization", None)


def memory_share_key(group: RolloutConfig | TeacherConfig, prefix: str = "rollout") -> str | None:
    """Dotted key of the selected engine's GPU memory share (`rollout.vllm.engine_kwargs.
    gpu_memory_utilization`); None for an engine without one."""
    kwarg = engine_spec(group.engine).memory_share_kwarg
    return None if kwarg is None else f"{option_key(group, 'engine_kwargs', prefix)}.{kwarg}"


def memory_share(group: RolloutConfig | TeacherConfig) -> float | None:
    """The GPU memory share set in the selected engine's `engine_kwargs`; None when unset."""
    kwarg = engine_spec(group.engine).memory_share_kwarg
    return None if kwarg is None else option(group, "engine_kwargs", {}).get(kwarg)


def memory_budget(group: RolloutConfig | TeacherConfig) -> int | None:
    """The cache bytes fixed in the selected engine's `engine_kwargs` (`EngineSpec.
    memory_budget_kwarg`); None when unset or the engine has no such key."""
    kwarg = engine_spec(group.engine).memory_budget_kwarg
    return None if kwarg is None else option(group, "engine_kwargs", {}).get(kwarg)


def add_engine_kwargs(group: RolloutConfig | TeacherConfig, kwargs: dict[str, Any]) -> None:
    """Add `kwargs` to the selected engine's `engine_kwargs`; keys already there are kept."""
    opts = engine_options(group)
    opts.engine_kwargs = {**kwargs, **opts.engine_kwargs}


def set_memory_share(group: RolloutConfig | TeacherConfig, fraction: float) -> None:
    """Set the selected engine's GPU memory share (the engine must have one)."""
    opts = engine_options(group)
    opts.engine_kwargs = {**opts.engine_kwargs, engine_spec(group.engine).memory_share_kwarg: fraction}


def min_gpus_per_actor(r: RolloutConfig) -> int:
    """GPUs one actor of a GPU-only engine needs (one per worker); 0 for engines that also run on CPU."""
    return tensor_parallel_size(r) if engine_spec(r.engine).needs_gpu else 0


def _changed(options: Any) -> list[str]:
    """Fields of an options dataclass that differ from its defaults."""
    default = type(options)()
    return [f.name for f in fields(options) if getattr(options, f.name) != getattr(default, f.name)]


def inert_options(cfg: RunConfig) -> list[tuple[str, str]]:
    """(key, message) for every option set in the section of an engine that is not the selected
    one (`rollout.vllm.sleep_level=2` with rollout.engine=hf): it would change nothing. The
    teacher's sections count only with the teacher enabled."""
    groups = [("rollout", cfg.rollout)] + ([("teacher", cfg.teacher)] if cfg.teacher.enabled else [])
    out = []
    for prefix, group in groups:
        if group.engine not in _ENGINES:
            continue  # reported as an unknown engine
        for spec in _ENGINES.values():
            if spec.section is None or spec.name == group.engine or spec.section == engine_spec(group.engine).section:
                continue
            for name in _changed(getattr(group, spec.section)):
                out.append(
                    (
                        f"{prefix}.{spec.section}.{name}",
                        f"an option of the {spec.name} engine "
                        f"({prefix}.engine={spec.name}), not of {prefix}.engine={group.engine}",
                    )
                )
    return out


def teacher_option_problems(cfg: RunConfig) -> list[tuple[str, str]]:
    """The teacher engine's rollout-only options (weights it never receives, sleep) stay at their defaults."""
    t = cfg.teacher
    opts, spec = engine_options(t), engine_spec(t.engine)
    changed = _changed(opts) if opts is not None else []
    return [
        (
            f"teacher.{spec.section}.{name}",
            f"a rollout engine's option; a teacher never receives weights "
            f"nor sleeps: leave it unset (rollout.{spec.section}.{name} sets it for the student's engines)",
        )
        for name in changed
        if name in spec.rollout_only
    ]


def engine_problems(cfg: RunConfig) -> list[tuple[str, str]]:
    """`rollout.engine` is registered and its own checks pass."""
    r = cfg.rollout
    if r.engine not in _ENGINES:
        return [("rollout.engine", f"unknown engine {r.engine!r}; choose one of {engine_names()}")]
    spec = engine_spec(r.engine)
    own = spec.problems(cfg) if spec.problems is not None else []
    return own + routing_problems(cfg, spec.section, engine_options(r))
