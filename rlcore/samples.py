"""Sample completions for people to read: every `logger.samples_every` RL steps a few of the
step's completions (prompt, completion, reward, policy version) go to `samples.jsonl` in the run
folder and, with wandb, to a wandb.Table (as prime-rl, verl and TRL show them)."""

from __future__ import annotations

from typing import Any, Callable

from rlcore.types import Group, Task


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


def sample_rows(groups: list[Group], decode: Callable[[list[int]], str], limit: int) -> list[dict[str, Any]]:
    """Up to `limit` scored samples, one per group in turn (so the rows cover many prompts):
    {prompt, completion, reward, version}; `version` is the oldest policy version among the
    sample's tokens. Failed samples are left out."""
    rows: list[dict[str, Any]] = []
    depth = max((len(g.samples) for g in groups), default=0)
    for i in range(depth):
        for g in groups:
            if len(rows) >= limit:
                return rows
            if i < len(g.samples) and not g.samples[i].failed:
                s = g.samples[i]
                version = s.min_version if any(s.loss_mask) else None
                rows.append({"prompt": prompt_text(g.task), "completion": decode(s.completion_ids),
                             "reward": float(s.reward), "version": version})
    return rows
