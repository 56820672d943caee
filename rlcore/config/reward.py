"""The reward runtime's section of the config schema (`env.reward.*`): how an environment's reward
and tool calls are run (deadline, isolation, memory, network) and what a failed call does.

Its own section, not `env.args` (which are the environment's own constructor arguments): every
environment takes it (:class:`rlcore.envs.base.Environment`). The keys it replaced, once flat in
`env.args`, are refused with their new key (:data:`MOVED`). Imports nothing but
:mod:`rlcore.config.bounds`, so the reward zygote, which unpickles an environment holding this
section, stays free of OmegaConf.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlcore.config.bounds import bounded, choice, field_problems


@dataclass
class RewardRuntimeConfig:
    """How an environment's reward and tool calls run, and what a failed call does."""

    timeout_s: float = bounded(10.0, ge=0, note="(0 = no deadline: calls run inline)")
    """Deadline of one sample's reward call (and of one turn's `env_response`), in seconds."""
    on_error: str = choice("fail", "zero", default="fail", noun="on_error")
    """A reward that raises, hangs or is not finite: `fail` (sample dropped, counted) or `zero` (scored 0)."""
    isolation: str = choice("worker", "thread", "process", default="worker", noun="isolation")
    """Where reward calls run: `worker` (reused processes killed at an overrun), `thread` or `process`."""
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


def moved_env_arg(name: str) -> str | None:
    """`env.args.<old key>` -> "moved to env.reward.<key>"; None for an environment's own argument."""
    return f"moved to env.reward.{MOVED[name]}" if name in MOVED else None


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
