"""The reward runtime's section of the config schema (`env.reward.*`): how an environment's reward
and tool calls are run (deadline, isolation, memory, network) and what a failed call does.

Its own section, not `env.args` (which are the environment's own constructor arguments): every
environment takes it (:class:`rlcore.envs.base.Environment`). The keys it replaced, once flat in
`env.args` (and the environment constructor's keywords of the same names), still work: they are
carried into this section with one warning each (:func:`carry_moved`, :data:`MOVED`). Imports nothing but
:mod:`rlcore.config.bounds`, so the reward zygote, which unpickles an environment holding this
section, stays free of OmegaConf.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

from rlcore.config.bounds import bounded, choice, field_problems


@dataclass
class RewardRuntimeConfig:
    """How an environment's reward and tool calls run, and what a failed call does."""

    timeout_s: Optional[float] = bounded(None, ge=0, note="(0 = no deadline: calls run inline)")
    """Deadline of one reward call or `env_response` turn, in s; unset: the environment's (10 s; mini_swe 60 s)."""
    on_error: str = choice("fail", "zero", default="fail", noun="on_error")
    """A reward that raises, hangs or is not finite: `fail` (sample dropped, counted) or `zero` (scored 0)."""
    isolation: Optional[str] = choice("worker", "thread", "process", None, default=None, noun="isolation")
    """Where reward calls run: `worker` (a process per call, from warm workers), `thread` or `process`; unset: the environment's (`worker`; `thread` for rlcore's own string rewards)."""
    workers: Optional[int] = bounded(None, ge=1, le=256)
    """`worker` isolation: reward workers one request's calls are spread over at once; unset: max(2, min(4, CPUs))."""
    max_abandoned_threads: int = bounded(4, ge=0)
    """Timed-out threads still running past which `thread` scoring moves to `process` (threads cannot be killed)."""
    memory_mb: int = bounded(2048, ge=0, note="(0 = unbounded)")
    """MiB a reward worker may grow by beyond what it started with; a call past it fails its sample."""
    network: bool = False
    """Give reward workers the host's network (and its credential-like variables); default none."""


MOVED = {
    "reward_timeout_s": "timeout_s",
    "on_reward_error": "on_error",
    "reward_isolation": "isolation",
    "max_abandoned_threads": "max_abandoned_threads",
    "reward_memory_mb": "memory_mb",
    "reward_network": "network",
}
"""The reward runtime's keys as they were in `env.args` -> their name in `env.reward`."""
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(RewardRuntimeConfig)}


def moved_env_arg(name: str) -> str | None:
    """`env.args.<old key>` -> "moved to env.reward.<key>"; None for an environment's own argument."""
    return f"moved to env.reward.{MOVED[name]}" if name in MOVED else None


def carry_moved(args: dict[str, Any], section: RewardRuntimeConfig) -> list[str]:
    """Move the reward runtime's old keys out of `args` (`env.args`, or an environment's keyword
    arguments) into `section`, in place; returns one warning line per key carried. A key set in
    both places to different values (the section's differing from its default) raises ValueError
    naming both: which one was meant cannot be told."""
    lines = []
    for old in [key for key in args if key in MOVED]:
        new, value = MOVED[old], args.pop(old)
        current = getattr(section, new)
        if current != value and current != _DEFAULTS[new]:
            raise ValueError(
                f"env.args.{old}: the old place of env.reward.{new}, which is set too "
                f"({value!r} here, {current!r} there): keep env.reward.{new} only"
            )
        setattr(section, new, value)
        lines.append(f"env.args.{old}: moved to env.reward.{new}; carried there (write env.reward.{new}={value})")
    return lines


def reward_runtime_problems(section: RewardRuntimeConfig) -> list[tuple[str, str]]:
    """(`env.reward.KEY`, message) for each value outside its field's bound or allowed values,
    and for a non-boolean `network` or a non-integer `memory_mb` (a section built in code has no
    type check; a composed one was checked while composing)."""
    out = field_problems(section, "env.reward.")
    if not isinstance(section.network, bool):
        out.append(("env.reward.network", f"must be true or false, got {section.network!r}"))
    if isinstance(section.memory_mb, bool) or not isinstance(section.memory_mb, int):
        out.append(("env.reward.memory_mb", f"must be an integer, got {section.memory_mb!r}"))
    return out
