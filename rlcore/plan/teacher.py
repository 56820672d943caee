"""The teacher of on-policy distillation, Ray-free: its model config, its engine config, and the
config checks that run before Ray starts (resources, same tokenizer as the student).

The teacher group itself (actors, placement group, the scoring stage before the buffer) is in
`actors/teacher.py`; the loss is :mod:`rlcore.algo.distill`.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

from rlcore.algo.registry import is_per_sequence
from rlcore.config import ModelConfig, RunConfig
from rlcore.engine.registry import (
    engine_names,
    engine_spec,
    memory_share,
    memory_share_key,
    option_key,
    teacher_option_problems,
    tensor_parallel_size,
)


def teacher_model_config(cfg: RunConfig) -> ModelConfig:
    """The teacher as a :class:`ModelConfig` (a random-weight teacher without `arch` takes the
    student's)."""
    t = cfg.teacher
    return ModelConfig(
        path=t.path,
        gguf_file=t.gguf_file,
        tokenizer=t.tokenizer,
        arch=dict(t.arch) if t.arch else dict(cfg.model.arch),
        seed=t.seed,
        dtype=t.dtype,
    )


def teacher_run_config(cfg: RunConfig) -> RunConfig:
    """The run config a teacher engine is built from (`make_engine` reads `model` and
    `rollout`): the teacher's model, its resources and its engine's section (`teacher.vllm` as
    `rollout.vllm`; validation kept its rollout-only options, quantization and sleep among them,
    at their defaults); weights never move."""
    t = cfg.teacher
    section = engine_spec(t.engine).section
    rollout = copy.copy(cfg.rollout)  # not dataclasses.replace: that drops plug-in sections
    rollout.engine, rollout.gpus_per_actor, rollout.cpus_per_actor = t.engine, t.gpus_per_actor, t.cpus_per_actor
    if section is not None:
        setattr(rollout, section, copy.deepcopy(getattr(t, section)))
    return dataclasses.replace(cfg, model=teacher_model_config(cfg), rollout=rollout)


def _is_local(path: str | None) -> bool:
    return bool(path) and (path.startswith((".", "/", "~")) or Path(path).expanduser().exists())


def tokenizer_fingerprint(tokenizer) -> tuple:
    """What two tokenizers must share for the teacher to score the student's token ids: the
    whole vocabulary (token -> id) and the special ids."""
    return (tuple(sorted(tokenizer.get_vocab().items())), tokenizer.eos_token_id, tokenizer.pad_token_id)


def _checkpoint_vocab_size(path: str) -> int | None:
    found = Path(path).expanduser() / "config.json"
    if not found.is_file():
        return None
    conf = json.loads(found.read_text())
    return conf.get("vocab_size") or conf.get("text_config", {}).get("vocab_size")


def tokenizer_problems(cfg: RunConfig) -> list[tuple[str, str]]:
    """Same tokenizer required, unless `teacher.cross_tokenizer` (then none: the teacher reads the
    student's text). Cheap: local tokenizers are loaded and compared (vocabulary and special
    ids); a hub id is compared when the teacher actor starts (`actors/teacher.py`)."""
    from rlcore.models.tokenizer_build import build_tokenizer

    t, m = cfg.teacher, cfg.model
    if t.cross_tokenizer:
        return []
    if t.tokenizer != m.tokenizer:
        return [
            (
                "teacher.tokenizer",
                f"{t.tokenizer!r} differs from model.tokenizer {m.tokenizer!r}: "
                "the teacher must use the student's tokenizer",
            )
        ]
    if t.tokenizer in ("char", "bpe"):
        size = _checkpoint_vocab_size(t.path) if _is_local(t.path) else None
        student = len(build_tokenizer(m))
        if size is not None and size > student:  # a checkpoint may pad its embedding, never shrink it
            return [("teacher.path", f"{t.path}: vocab_size {size} is not the {t.tokenizer} tokenizer's ({student})")]
        return []
    if not (_is_local(t.path) and _is_local(m.path)):
        return []
    try:
        same = tokenizer_fingerprint(build_tokenizer(teacher_model_config(cfg))) == tokenizer_fingerprint(
            build_tokenizer(m)
        )
    except (OSError, ValueError) as exc:
        return [("teacher.path", f"cannot load the teacher's tokenizer: {exc}".splitlines()[0])]
    if not same:
        return [
            (
                "teacher.path",
                f"{t.path}: its tokenizer differs from the student's ({m.path}); "
                "on-policy distillation needs the same tokenizer",
            )
        ]
    return []


def config_problems(cfg: RunConfig) -> list[tuple[str, str]]:
    """`teacher.*`, checked only when the teacher is enabled (`rl` mode)."""
    t, out = cfg.teacher, []
    if not t.enabled:
        return out
    if cfg.mode != "rl":
        return [("teacher.enabled", f"on-policy distillation runs in mode=rl, got mode={cfg.mode}")]
    if cfg.algo.filter_zero_adv_groups and (t.kl_coef > 0 or t.top_k > 0):
        out.append(
            (
                "algo.filter_zero_adv_groups",
                "drops groups whose rewards are all equal, but with a teacher "
                "(teacher.kl_coef or teacher.top_k > 0) their tokens still carry a distillation signal: set it false",
            )
        )
    if t.engine not in engine_names():
        out.append(("teacher.engine", f"unknown engine {t.engine!r}; choose one of {engine_names()}"))
    else:
        out.extend(teacher_option_problems(cfg))
        # `tensor_parallel_size` > 0 is its field's bound (rlcore.config.bounds)
        if tensor_parallel_size(t) > 0 and engine_spec(t.engine).needs_gpu:
            out.extend(gpu_share_problems(cfg))
    if t.path is None and "model_type" not in (t.arch or cfg.model.arch):
        out.append(("teacher.arch", "needs model_type when teacher.path is null"))
    # a hub id is "org/name"; anything else (./x, /x, ~/x, a/b/c) names a local directory
    local_form = t.path and (t.path.startswith((".", "/", "~")) or t.path.count("/") > 1)
    if local_form and not Path(t.path).expanduser().exists():
        out.append(
            ("teacher.path", f"directory {t.path!r} does not exist (train the teacher first; see the recipe's header)")
        )
    # each value's own bound (num_actors > 0, kl_coef >= 0, ...) is on its field: rlcore.config.bounds
    top_k = top_k_problems(cfg)
    out.extend(top_k)
    if not top_k and t.kl_coef == 0 and t.reward_coef == 0 and not (t.top_k > 0 and t.top_k_coef > 0):
        out.append(("teacher.kl_coef", "kl_coef, reward_coef and top_k_coef (or top_k) are all 0: nothing to train on"))
    if t.kl_coef > 0 and is_per_sequence(cfg.algo.loss):
        out.append(
            (
                "teacher.kl_coef",
                "per-token distillation advantages need a token-level loss; "
                f"algo.loss={cfg.algo.loss} uses one ratio per sequence",
            )
        )
    if not out:
        out.extend(tokenizer_problems(cfg))
    return out


def top_k_problems(cfg: RunConfig) -> list[tuple[str, str]]:
    """`teacher.top_k`: a whole number, scored in the student's own tokens by an engine that returns
    top-k logprobs (`EngineSpec.scores_top_k`), for a per-token loss (a k past the vocabulary
    takes all of it)."""
    t = cfg.teacher
    if isinstance(t.top_k, bool) or not isinstance(t.top_k, int) or t.top_k < 0:
        return [("teacher.top_k", f"must be a whole number >= 0, got {t.top_k!r}")]
    if t.top_k == 0:
        return []
    if not t.top_k_coef >= 0:
        return [("teacher.top_k_coef", f"must be >= 0, got {t.top_k_coef!r}")]
    if t.cross_tokenizer:
        return [
            (
                "teacher.top_k",
                "the teacher's top-k tokens are its own; with teacher.cross_tokenizer they are "
                "not the student's: use the sampled-token advantage (teacher.kl_coef) alone",
            )
        ]
    if t.engine in engine_names() and not engine_spec(t.engine).scores_top_k:
        able = [n for n in engine_names() if engine_spec(n).scores_top_k]
        return [("teacher.top_k", f"the {t.engine} engine does not return top-k logprobs yet; engines that do: {able}")]
    if is_per_sequence(cfg.algo.loss):
        return [("teacher.top_k", f"the top-k term is per token; algo.loss={cfg.algo.loss} is per sequence")]
    return []


def gpu_share_problems(cfg: RunConfig) -> list[tuple[str, str]]:
    """A GPU-only teacher engine (vLLM) takes whole GPUs (>= tensor_parallel_size), or a share of
    one GPU (0 < g < 1, tensor_parallel_size 1) next to another tenant (e.g. a trainer rank with
    gpus_per_rank 0.5): then its memory share (the engine's `memory_share_kwarg`, vLLM's
    `teacher.vllm.engine_kwargs.gpu_memory_utilization`) must be set and stay within the share Ray reserves
    (vLLM's default 0.9 would starve the other tenant). Beside colocated trainer ranks and engines
    the memory plan counts it (`rlcore.plan.placement.colocated_teacher_problems`,
    `rlcore.plan.memory.teacher_bytes`)."""
    t = cfg.teacher
    tp, share = tensor_parallel_size(t), engine_spec(t.engine).memory_share_kwarg
    if t.gpus_per_actor >= tp:
        return []
    if not 0 < t.gpus_per_actor < 1 or tp != 1 or share is None:
        return [
            (
                "teacher.gpus_per_actor",
                f"the {t.engine} engine needs {option_key(t, 'tensor_parallel_size', 'teacher')} "
                f"({tp}) GPUs per actor, or a share (0, 1) of one GPU with tensor_parallel_size 1; got {t.gpus_per_actor}",
            )
        ]
    util = memory_share(t)
    if util is None or not 0 < float(util) <= t.gpus_per_actor:
        return [
            (
                memory_share_key(t, "teacher"),
                f"a teacher on {t.gpus_per_actor:g} of a GPU needs {share} in (0, {t.gpus_per_actor:g}], got {util}",
            )
        ]
    return []


def resolved(cfg: RunConfig) -> RunConfig:
    """`cfg` with a local `teacher.path` made absolute (actors need not share the driver's cwd)."""
    t = cfg.teacher
    if not _is_local(t.path) or not Path(t.path).expanduser().exists():
        return cfg
    return dataclasses.replace(cfg, teacher=dataclasses.replace(t, path=str(Path(t.path).expanduser().resolve())))


def gpu_share(cfg: RunConfig) -> float:
    """GPU share of each GPU teacher actor in an RL run (0 without a teacher or with a CPU one)."""
    t = cfg.teacher
    return t.gpus_per_actor if cfg.mode == "rl" and t.enabled and t.gpus_per_actor > 0 else 0.0


def teacher_resources(cfg: RunConfig) -> tuple[float, float]:
    """(CPUs, GPUs) the teacher placement group asks for (0, 0 when disabled)."""
    t = cfg.teacher
    if not t.enabled or cfg.mode != "rl":
        return 0.0, 0.0
    return t.num_actors * t.cpus_per_actor, t.num_actors * t.gpus_per_actor
