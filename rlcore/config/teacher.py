"""The teacher section of the config schema (on-policy distillation, `teacher.*`).

Kept out of :mod:`rlcore.config` only for size; :class:`rlcore.config.RunConfig` holds it as
`teacher`. Cross-field rules live in :func:`rlcore.plan.teacher.config_problems`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from rlcore.config.engines import HFOptions, VLLMOptions
from rlcore.config.plugins import PluginSections


@dataclass
class TeacherConfig(PluginSections):
    """A teacher group: engines that score the student's finished samples (on-policy distillation)."""

    enabled: bool = False
    """Score every finished sample with the teacher and add the per-token reverse-KL advantage."""
    path: Optional[str] = None
    """Teacher model: Hugging Face id or local directory; null builds a random-weight model from `arch` (tests)."""
    gguf_file: Optional[str] = None
    """GGUF file inside `path` (hf engine)."""
    tokenizer: str = "char"
    """`char`, `bpe` or `auto` (the tokenizer `path` ships); the student's, unless `cross_tokenizer`."""
    cross_tokenizer: bool = False
    """The teacher may use another tokenizer: it scores the student's text in its own tokens and its logprobs
    are carried back to the student's tokens by character spans (`rlcore/algo/span_align.py`)."""
    arch: dict[str, Any] = field(default_factory=dict)
    """transformers config fields of a random-weight teacher (used when `path` is null; empty = `model.arch`)."""
    seed: int = 1
    """Seed of a random-weight teacher's initialisation."""
    dtype: str = "float32"
    """Teacher weight dtype (`float32`, `bfloat16`, `float16`)."""
    engine: str = "hf"
    """`hf` (transformers, CPU or GPU) or `vllm` (GPU); it reads its own section (`teacher.vllm.*`,
    `teacher.hf.*`); the teacher never receives weights."""
    num_actors: int = 1
    """Teacher engine replicas (one actor each, on the teacher placement group)."""
    cpus_per_actor: float = 1.0
    """CPUs reserved in each teacher bundle."""
    gpus_per_actor: float = 0.0
    """GPUs reserved in each teacher bundle (0 = CPU; with the vllm engine >= vllm.tensor_parallel_size)."""
    max_requests_per_actor: int = 2
    """Score calls in flight per teacher actor (vLLM batches them; more hides latency)."""
    max_restarts: int = 3
    """Times Ray restarts a dead teacher actor (its calls in flight are counted failed); -1 = always."""
    score_timeout_s: float = 120.0
    """Longest one score call may take; its samples are then counted failed."""
    start_timeout_s: float = 600.0
    """Longest the teacher actors may take to load their model."""
    kl_coef: float = 1.0
    """Weight of the per-token distillation advantage (log p_teacher - log p_student)."""
    reward_coef: float = 1.0
    """Weight of the environment reward's advantage (0 = pure distillation)."""
    kl_baseline: bool = False
    """Subtract the batch mean of (log p_teacher - log p_student) from the distillation advantage
    (variance reduction; the expected gradient is unchanged)."""
    kl_deadband: float = 0.0
    """Tokens with |log p_teacher - log p_student| at most this get no distillation advantage, nor top-k term when
    all k are within it (nats; keeps a converged student from drifting on noise gradients; 0 = exact)."""
    top_k: int = 0
    """Teacher's top-k next-token logprobs at every student position, fitted by a KL term (`rlcore.algo.distill.top_k_loss`); 0 = off."""
    top_k_coef: float = 1.0
    """Weight of the top-k distillation term (used when `top_k` > 0)."""
    vllm: VLLMOptions = field(default_factory=VLLMOptions)
    """Options of a vllm teacher (`teacher.vllm.*`: tensor_parallel_size, engine_kwargs; the
    rollout-only options must keep their defaults)."""
    hf: HFOptions = field(default_factory=HFOptions)
    """Options of an hf teacher (`teacher.hf.*`)."""
