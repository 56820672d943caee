"""Sample completions for people to read: every `logger.samples_every` RL steps a few of the
step's completions (prompt, completion, reward, policy version) go to `samples.jsonl` in the run
folder and, with wandb, to a wandb.Table (as prime-rl, verl and TRL show them). Each row also
carries its completion token by token (`tokens`, `token_versions`, `token_logprobs`: the text,
policy version and engine logprob of each token) for the live page's sample inspector, and
`trainer_logprobs`: the trainer's logprob of each token from that step's own forward (the policy
before the step's update, the logprob the loss's ratio and the mismatch metrics use; null for an
environment token), which the driver reads from the trainer ranks after the step for the rows
shown only (`shown_keys`, `actors.trainer.TrainerRank.last_step_logprobs`) and aligns with the
completion's tokens here (`completion_logprobs`).
Failed samples of the step (a few per reason, `rlcore.report.failures.FailureLog.take_examples`)
are rows too, with `failed_reason`, `error` and a null reward (`failed_rows`)."""

from __future__ import annotations

from typing import Any, Callable

from rlcore.report.failures import FailedExample
from rlcore.types import GroupMeta, Sample, SampleMeta, Task


def due(step: int, every: int) -> bool:
    """Train step `step` (1-based) logs samples when `every` > 0 divides it."""
    return every > 0 and step % every == 0


def prompt_text(task: Task) -> str:
    """The last user message of the task (what the policy was asked)."""
    for message in reversed(task.messages):
        if message.get("role") == "user":
            content = message.get("content")
            return content if isinstance(content, str) else str(content)
    return str(task.messages)


def pick(groups: list[GroupMeta], limit: int) -> list[tuple[int, SampleMeta]]:
    """The samples a table shows, from metadata: up to `limit` scored samples, one per group in
    turn (so the rows cover many prompts), as (position of the group in `groups`, sample).
    Failed samples are left out."""
    picked: list[tuple[int, SampleMeta]] = []
    depth = max((len(g.samples) for g in groups), default=0)
    for i in range(depth):
        for gi, g in enumerate(groups):
            if len(picked) < limit and i < len(g.samples) and not g.samples[i].failed:
                picked.append((gi, g.samples[i]))
    return picked


def shown_keys(groups: list[GroupMeta], limit: int) -> list[tuple[int, int]]:
    """(group position, sample index) of each sample :func:`pick` shows: the samples whose
    trainer logprobs the driver asks the trainer ranks for."""
    return [(gi, s.index) for gi, s in pick(groups, limit)]


def completion_logprobs(sample: Sample, packed: list[float]) -> list[float | None]:
    """The trainer logprob of each completion token of `sample` (aligned with `completion_ids`;
    None for an environment token and for a first token that no position predicts), from
    `packed`: what the trainer computed along the sample's packed positions (its prompt, then its
    completion), position t scoring token t + 1."""
    p, mask = len(sample.prompt_ids), sample.loss_mask
    return [
        packed[p + t - 1] if p + t >= 1 and t < len(mask) and mask[t] else None
        for t in range(len(sample.completion_ids))
    ]


def sample_rows(
    groups: list[GroupMeta],
    decode: Callable[[list[int]], str],
    limit: int,
    fetch: Callable[[list], list[list[Sample]]] = list,
    trainer_logprobs: dict[tuple[int, int], list] | None = None,
) -> list[dict[str, Any]]:
    """Up to `limit` scored samples (:func:`pick`):
    {prompt, completion, reward, version, tokens, token_versions, token_logprobs[, trainer_logprobs]};
    `version` is the oldest policy version among the sample's tokens; `tokens` are the completion's
    tokens decoded one by one (`decode([id])`), with each one's policy version (-1: an environment
    token) and engine (behaviour) logprob; `trainer_logprobs` when `trainer_logprobs` holds the
    sample's key (:func:`shown_keys`): the trainer's logprobs along its packed positions
    (:func:`completion_logprobs`). `fetch` (handles -> each group's `list[Sample]`; default:
    the handles are the lists) is called once, with the token data handles of the groups shown only."""
    picked = pick(groups, limit)
    shown = list(dict.fromkeys(gi for gi, _ in picked))
    data = dict(zip(shown, fetch([groups[gi].data for gi in shown]))) if shown else {}
    trainer = trainer_logprobs or {}
    rows = []
    for gi, s in picked:
        row = {
            "prompt": prompt_text(groups[gi].task),
            "completion": decode(data[gi][s.index].completion_ids),
            "reward": float(s.reward),
            "version": s.min_version if s.loss_tokens else None,
            **token_columns(data[gi][s.index], decode),
        }
        if (gi, s.index) in trainer:
            aligned = completion_logprobs(data[gi][s.index], trainer[gi, s.index])
            row["trainer_logprobs"] = [None if x is None else round(float(x), 4) for x in aligned]
        rows.append(row)
    return rows


def failed_rows(
    examples: list[FailedExample],
    decode: Callable[[list[int]], str],
    fetch: Callable[[list], list[list[Sample]]] = list,
) -> list[dict[str, Any]]:
    """One row per failed sample kept: {prompt, completion, reward: None, version: None,
    failed_reason, error} and, when its token data came back, its token columns. `fetch` as in
    :func:`sample_rows`, called once with the handles of the examples' groups."""
    handles = list({id(e.group): e.group for e in examples if e.group is not None}.values())
    data = dict(zip([id(g) for g in handles], fetch([g.data for g in handles]))) if handles else {}
    rows = []
    for e in examples:
        row: dict[str, Any] = {
            "prompt": prompt_text(e.task) if e.task is not None else "",
            "completion": "",
            "reward": None,
            "version": None,
            "failed_reason": e.reason,
            "error": e.error,
        }
        sample = data[id(e.group)][e.index] if e.group is not None else None
        if sample is not None:
            row.update(completion=decode(sample.completion_ids), **token_columns(sample, decode))
        rows.append(row)
    return rows


TOKEN_COLUMNS = ("tokens", "token_versions", "token_logprobs", "trainer_logprobs")


def token_columns(sample: Sample, decode: Callable[[list[int]], str]) -> dict[str, list]:
    """The completion token by token: text, policy version, engine logprob (4 decimals)."""
    return {
        "tokens": [decode([t]) for t in sample.completion_ids],
        "token_versions": list(sample.versions),
        "token_logprobs": [round(float(x), 4) for x in sample.logprobs],
    }
