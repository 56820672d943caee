"""The run summary printed when a run ends: a pure function of the step records.

Reward (or SFT loss) is compared as the mean of the first `WINDOW` steps against the mean of the
last `WINDOW` steps (half the run each when it is shorter): single steps are noise, one step's
batch being a few dozen samples. Rates are totals over totals (sum of tokens / sum of step
seconds), not means of per-step rates.
"""

from __future__ import annotations

from typing import Any, Sequence

WINDOW = 10
"""Steps averaged at each end of a run for the first/last comparison."""


def window(steps: int) -> int:
    """Steps per window: `WINDOW`, or half the run when it is shorter than two windows (so the
    first and last windows never overlap)."""
    return max(1, min(WINDOW, steps // 2))


def window_means(history: Sequence[dict[str, Any]], key: str) -> tuple[float, float, int] | None:
    """(mean of `key` over the first w records that have it, mean over the last w, w) with
    w = window(count); None when no record has it."""
    values = [float(r[key]) for r in history if r.get(key) is not None]
    if not values:
        return None
    w = window(len(values))
    return sum(values[:w]) / w, sum(values[-w:]) / w, w


def _steps(n: int) -> str:
    return f"{n} step" if n == 1 else f"{n} steps"


def is_zero_advantage(record: dict[str, Any]) -> bool:
    """A step in which every group had zero advantage (all rewards within each group equal):
    its policy-gradient loss and gradient are exactly zero, whatever the reward."""
    return record.get("zero_adv_frac") == 1.0


def zero_advantage_steps(history: Sequence[dict[str, Any]]) -> int:
    return sum(is_zero_advantage(r) for r in history)


def _total(history: Sequence[dict[str, Any]], key: str) -> float:
    return sum(float(r[key]) for r in history if r.get(key) is not None)


def rates(history: Sequence[dict[str, Any]]) -> tuple[float, float]:
    """(train tokens/s, samples/s) over the whole run: sum(tokens_per_s * step_time_s) /
    sum(step_time_s), the same for samples."""
    seconds = _total(history, "step_time_s")
    if seconds <= 0:
        return 0.0, 0.0
    tokens = sum(r["tokens_per_s"] * r["step_time_s"] for r in history if r.get("tokens_per_s") is not None)
    samples = sum(r["samples_per_s"] * r["step_time_s"] for r in history if r.get("samples_per_s") is not None)
    return tokens / seconds, samples / seconds


def format_phases(phases: Sequence[tuple[str, float]]) -> str:
    return ", ".join(f"{name} {seconds:.1f}s" for name, seconds in phases)


def rl_summary(
    history: Sequence[dict[str, Any]],
    eval_rows: Sequence[dict[str, Any]] = (),
    phases: Sequence[tuple[str, float]] = (),
    artifact: str = "",
    startup_s: float | None = None,
) -> list[str]:
    """Lines for an RL run: steps and wall-clock, reward first/last (window means), eval
    first/last (if eval ran), tokens/s and samples/s, seconds in generate/train/sync (sums over
    steps), the canary's calibrated bounds, zero-advantage steps, start-up phases, and `artifact` (the plot or metrics path)."""
    n = len(history)
    lines = [f"{n} steps in {history[-1].get('elapsed_s', _total(history, 'step_time_s')):.0f}s"]
    reward = window_means(history, "reward_mean")
    if reward is not None:
        lines.append(f"reward {reward[0]:.3f} -> {reward[1]:.3f} (means of the first and last {_steps(reward[2])})")
    evals = [r for r in eval_rows if r.get("eval/reward_mean") is not None]
    if evals:
        a, b = evals[0], evals[-1]
        lines.append(
            f"eval reward {a['eval/reward_mean']:.3f} (step {a['step']}) -> "
            f"{b['eval/reward_mean']:.3f} (step {b['step']})"
        )
    tps, sps = rates(history)
    lines.append(f"throughput {tps:.0f} tokens/s, {sps:.1f} samples/s")
    times = [
        (label, _total(history, key))
        for label, key in (("generate", "generate_time_s"), ("train", "train_time_s"), ("sync", "sync_time_s"))
        if any(r.get(key) is not None for r in history)
    ]
    if times:
        lines.append("time " + ", ".join(f"{label} {s:.1f}s" for label, s in times) + " (sums over steps)")
    bounds = next((r for r in history if r.get("canary_mean_limit") is not None), None)
    if bounds is not None:
        lines.append(
            f"canary bounds mean gap {bounds['canary_mean_limit']:.4f}, max gap {bounds['canary_max_limit']:.4f} "
            f"nats (calibrated on the first sync: mean {bounds['canary_baseline_mean']:.4f}, max "
            f"{bounds['canary_baseline_max']:.4f}); largest seen mean "
            f"{max(r.get('canary_mean_gap', 0.0) for r in history):.4f}"
        )
    zero = zero_advantage_steps(history)
    if zero:
        lines.append(f"zero-advantage steps {zero} of {n} (no learning signal in those steps)")
    return lines + closing_lines(phases, artifact, startup_s)


def closing_lines(phases: Sequence[tuple[str, float]], artifact: str, startup_s: float | None = None) -> list[str]:
    """The lines every summary ends with: the start-up phases and where the plot or metrics are.
    `startup_s`: the wall time from the process's start to step 1 (phases that ran at once
    overlap, so it is not their sum); None: the phases' sum."""
    if startup_s is not None:
        out = [f"start-up {startup_s:.1f}s to step 1 (from the process's start): {format_phases(phases)}"]
    else:
        out = [f"start-up {sum(s for _, s in phases):.1f}s: {format_phases(phases)}"] if phases else []
    return out + ([artifact] if artifact else [])


def sft_summary(
    history: Sequence[dict[str, Any]], phases: Sequence[tuple[str, float]] = (), artifact: str = ""
) -> list[str]:
    loss = window_means(history, "loss")
    lines = [f"{len(history)} SFT steps"]
    if loss is not None:
        lines.append(f"loss {loss[0]:.4f} -> {loss[1]:.4f} (means of the first and last {_steps(loss[2])})")
    return lines + closing_lines(phases, artifact)


def eval_summary(
    history: Sequence[dict[str, Any]], phases: Sequence[tuple[str, float]] = (), artifact: str = ""
) -> list[str]:
    last = history[-1]
    passes = ", ".join(
        f"{k.removeprefix('eval/')} {v:.3f}" for k, v in sorted(last.items()) if k.startswith("eval/pass@")
    )
    lines = [
        f"eval of step {last['step']}: reward_mean {last['eval/reward_mean']:.3f}" + (f", {passes}" if passes else "")
    ]
    return lines + closing_lines(phases, artifact)


def run_summary(
    mode: str,
    history: Sequence[dict[str, Any]],
    eval_rows: Sequence[dict[str, Any]] = (),
    phases: Sequence[tuple[str, float]] = (),
    artifact: str = "",
    startup_s: float | None = None,
) -> str:
    """The whole summary: a `rlcore: done:` line, then one indented line per figure; `startup_s`
    (RL): the wall time from the process's start to step 1."""
    if mode == "sft":
        lines = sft_summary(history, phases, artifact)
    elif mode == "eval":
        lines = eval_summary(history, phases, artifact)
    else:
        lines = rl_summary(history, eval_rows, phases, artifact, startup_s)
    return "\n".join([f"rlcore: done: {lines[0]}"] + [f"  {ln}" for ln in lines[1:]])
