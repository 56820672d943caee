"""The teacher section of the config schema (on-policy distillation, `teacher.*`).

Kept out of :mod:`rlcore.config` only for size; :class:`rlcore.config.RunConfig` holds it as
`teacher`. Cross-field rules live in :func:`rlcore.plan.teacher.config_problems`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from rlcore.config.bounds import bounded, choice
from rlcore.config.engines import EngineGroupConfig


@dataclass
class TeacherConfig(EngineGroupConfig):
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
    dtype: str = choice("float32", "bfloat16", "float16", default="float32", noun="dtype")
    """Teacher weight dtype (`float32`, `bfloat16`, `float16`)."""
    max_requests_per_actor: int = bounded(2, gt=0)
    """Score calls in flight at each teacher actor (the driver queues the rest; the actor serves
    them and one control call at once)."""
    score_timeout_s: float = bounded(120.0, gt=0)
    """Longest one score call may take; its samples are then counted failed."""
    start_timeout_s: float = bounded(600.0, gt=0)
    """Longest the teacher actors may take to load their model."""
    kl_coef: float = bounded(1.0, ge=0)
    """Weight of the per-token distillation advantage (log p_teacher - log p_student)."""
    reward_coef: float = bounded(1.0, ge=0)
    """Weight of the environment reward's advantage (0 = pure distillation)."""
    kl_baseline: bool = False
    """Subtract the batch mean of (log p_teacher - log p_student) from the distillation advantage
    (variance reduction; the expected gradient is unchanged)."""
    kl_deadband: float = bounded(0.0, ge=0)
    """Tokens with |log p_teacher - log p_student| at most this get no distillation advantage, nor top-k term when
    all k are within it (nats; keeps a converged student from drifting on noise gradients; 0 = exact)."""
    top_k: int = 0
    """Teacher's top-k next-token logprobs at every student position, fitted by a KL term (`rlcore.algo.distill.top_k_loss`); 0 = off."""
    top_k_coef: float = 1.0
    """Weight of the top-k distillation term (used when `top_k` > 0)."""
