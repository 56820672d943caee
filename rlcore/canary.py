"""The weight-sync canary: after every sync, the engine's and the trainer's teacher-forced
logprobs of a fixed prompt set must agree within a bf16 tolerance (looser with FP8, see
:func:`canary_limits`).

A correct sync leaves only kernel-level bf16 differences (0.03-0.06 nats max over 4 x 16 tokens
was seen for a random-weight Qwen3-0.6B-shaped model: vLLM vs transformers); stale or corrupted
weights give gaps of whole nats (3.7-5.7 seen). Both a max and a mean bound are checked: the max
catches one broken layer that hits a few positions, the mean is robust to a single
low-probability token whose logprob is bf16-sensitive.

The canary cannot tell apart two policies whose logprobs on the prompt set differ by less than
the tolerance (e.g. one tiny optimizer step): it guards against wrong or missing weights, not
against being one small step stale. Version bookkeeping does that.

Pure: lists of floats in, a result out. :func:`teacher_forced_logprobs` (torch only) is the
trainer-side reference for a transformers causal LM.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Sequence

import torch

from rlcore.engine.registry import quantization
from rlcore.models.render import render_prompt

DEFAULT_MAX_GAP = 1.0
"""Nats; a correct sync stays an order of magnitude below, a stale one above."""
DEFAULT_MEAN_GAP = 0.1
"""Nats, averaged over all canary tokens."""
FP8_MAX_GAP = 2.0
"""Nats; the max bound when either side runs FP8 (``rollout.vllm.quantization`` or ``trainer.fp8``)."""
FP8_MEAN_GAP = 0.25
"""Nats; the mean bound with FP8."""
CHECKPOINT_MAX_GAP = 2.0
"""Nats; the max bound for a real checkpoint (`model.path` set), see `canary_limits`."""
CHECKPOINT_MEAN_GAP = 0.25
"""Nats; the mean bound for a real checkpoint."""


def uses_fp8(cfg) -> bool:
    """Whether the engines or the trainer run FP8 matmuls (a :class:`rlcore.config.RunConfig`)."""
    return bool(quantization(cfg.rollout)) or getattr(cfg.trainer, "fp8", "none") != "none"


def canary_limits(cfg) -> tuple[float, float]:
    """``(max_gap, mean_gap)`` for a run: ``rollout.canary_max_gap`` / ``canary_mean_gap`` when
    set, else the bf16 defaults, or the FP8 ones when either side runs FP8.

    Why looser with FP8: per-tensor e4m3 weights (3 mantissa bits, up to ~6% relative rounding
    per weight) and per-token FP8 activations move every logit, so a *correct* sync leaves gaps
    several times the bf16 kernel noise, largest on low-probability tokens. The FP8 bounds (2.0
    max, 0.25 mean) are 2-2.5x the bf16 ones and still well under the 3.7-5.7 nats of a stale or
    mis-mapped sync; the mean bound is the one that catches a wholly wrong sync.

    Why looser with a real checkpoint (`model.path` set): the canary scores the environment's
    reference answers, and a trained model's peaked distribution puts some of their tokens far
    out in the tail, where bf16 rounding of the logits moves the logprob most. Measured on
    nvidia-h200 with SmolLM2-135M-Instruct (docs/benchmarks.md, issue 20): correct syncs left
    gaps up to 0.79 max / 0.15 mean, so the random-weight bounds stopped a healthy run. A wrong
    sync of a real model (wrong or missing tensors) still moves whole nats.
    """
    r = cfg.rollout
    fp8 = uses_fp8(cfg)
    real = bool(cfg.model.path)
    default_max = FP8_MAX_GAP if fp8 else CHECKPOINT_MAX_GAP if real else DEFAULT_MAX_GAP
    default_mean = FP8_MEAN_GAP if fp8 else CHECKPOINT_MEAN_GAP if real else DEFAULT_MEAN_GAP
    max_gap = r.canary_max_gap if r.canary_max_gap is not None else default_max
    mean_gap = r.canary_mean_gap if r.canary_mean_gap is not None else default_mean
    return float(max_gap), float(mean_gap)


class CanaryError(RuntimeError):
    """Engine and trainer disagree on the canary prompts: the engine is not serving the trainer's
    weights (stale, partial or mis-mapped sync)."""


@dataclass(frozen=True)
class CanaryResult:
    """Outcome of one canary check (gaps in nats, absolute logprob differences)."""

    max_gap: float
    mean_gap: float
    num_tokens: int
    max_gap_limit: float
    mean_gap_limit: float
    worst: tuple[int, int]
    """(prompt index, token index) of the largest gap."""

    @property
    def passed(self) -> bool:
        return self.max_gap <= self.max_gap_limit and self.mean_gap <= self.mean_gap_limit

    def describe(self) -> str:
        return (f"canary max gap {self.max_gap:.4f} (limit {self.max_gap_limit}), mean gap "
                f"{self.mean_gap:.4f} (limit {self.mean_gap_limit}) over {self.num_tokens} tokens, "
                f"worst at prompt {self.worst[0]} token {self.worst[1]}")


def compare_logprobs(engine: Sequence[Sequence[float]], trainer: Sequence[Sequence[float]], *,
                     max_gap: float = DEFAULT_MAX_GAP, mean_gap: float = DEFAULT_MEAN_GAP,
                     raise_on_fail: bool = True) -> CanaryResult:
    """Compare per-token logprobs (one list per canary prompt, same lengths on both sides).

    Returns the gaps; raises :class:`CanaryError` when ``raise_on_fail`` and either bound is
    exceeded, or when a value is not finite (a NaN is never a pass). Raises ``ValueError`` when
    the shapes differ (a bug in the caller, not a sync failure).
    """
    if len(engine) != len(trainer):
        raise ValueError(f"canary: {len(engine)} engine sequences vs {len(trainer)} trainer sequences")
    gaps: list[float] = []
    worst, worst_at = -1.0, (0, 0)
    for i, (e_seq, t_seq) in enumerate(zip(engine, trainer)):
        if len(e_seq) != len(t_seq):
            raise ValueError(f"canary: prompt {i} has {len(e_seq)} engine vs {len(t_seq)} trainer logprobs")
        for j, (e, t) in enumerate(zip(e_seq, t_seq)):
            gap = abs(float(e) - float(t))
            if not math.isfinite(gap):
                gap = math.inf
            gaps.append(gap)
            if gap > worst:
                worst, worst_at = gap, (i, j)
    if not gaps:
        raise ValueError("canary: no tokens to compare")
    result = CanaryResult(max_gap=max(gaps), mean_gap=sum(gaps) / len(gaps), num_tokens=len(gaps),
                          max_gap_limit=max_gap, mean_gap_limit=mean_gap, worst=worst_at)
    if raise_on_fail and not result.passed:
        raise CanaryError("engine and trainer disagree after weight sync: " + result.describe())
    return result


def canary_prompts(vocab_size: int, num_prompts: int = 4, prompt_len: int = 16, completion_len: int = 16,
                   seed: int = 1234, low: int = 0) -> list[tuple[list[int], list[int]]]:
    """A fixed, seeded set of (prompt ids, completion ids) drawn from ``[low, vocab_size)``.
    Random tokens exercise every layer; real prompts from the task can be used instead."""
    rng = random.Random(seed)
    return [([rng.randrange(low, vocab_size) for _ in range(prompt_len)],
             [rng.randrange(low, vocab_size) for _ in range(completion_len)]) for _ in range(num_prompts)]


def task_canary_pairs(tasks: Sequence, tokenizer, max_prompt_tokens: int = 128,
                      completion_len: int = 16) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, completion ids) from an environment's own tasks: each task's messages through
    the chat template (the first `max_prompt_tokens` ids) and, as the completion, the task's
    reference answer as text (the next task's prompt tail when it has none), `completion_len`
    ids at most. Text the policy actually sees keeps the canary's tolerance honest: random ids
    made FP8 engines trip the bound while their mismatch KL on real samples was 1e-4."""

    pairs = []
    for i, task in enumerate(tasks):
        prompt = render_prompt(tokenizer, task.messages)[:max_prompt_tokens]
        text = str(task.answer) if task.answer is not None else str(tasks[(i + 1) % len(tasks)].messages[-1]["content"])
        completion = tokenizer(text, add_special_tokens=False).input_ids[:completion_len]
        if prompt and completion:
            pairs.append((prompt, completion))
    return pairs


@torch.no_grad()
def teacher_forced_logprobs(model: torch.nn.Module, pairs: Sequence[tuple[Sequence[int], Sequence[int]]],
                            temperature: float = 1.0) -> list[list[float]]:
    """Logprob of each completion token given everything before it, under ``log_softmax(logits /
    temperature)`` in fp32, for a transformers causal LM (``model(input_ids).logits``)."""
    device = next(model.parameters()).device
    out: list[list[float]] = []
    for prompt, completion in pairs:
        ids = torch.tensor([list(prompt) + list(completion)], device=device)
        logits = model(ids).logits[0].float()
        start = len(prompt)
        # logits at position i predict token i + 1
        lp = torch.log_softmax(logits[start - 1:-1] / temperature, dim=-1)
        target = ids[0, start:]
        out.append(lp.gather(-1, target[:, None])[:, 0].tolist())
    return out
