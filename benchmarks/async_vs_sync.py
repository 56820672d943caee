"""Async vs sync: the same recipe with max_off_policy_steps = 0 and > 0, through the real CLI.

    python benchmarks/async_vs_sync.py --steps 30 --off-policy 0 1 2 [--reps 5] -- [extra overrides]

Runs `python -m rlcore.run` once per staleness bound (`--reps` times, interleaved: 0 1 2 0 1 2 ...),
reads each run's metrics.jsonl, and prints samples/s (trained samples per wall second over the
steps after `--warmup`, and over the last half of those alone: the *steady* rate, without the
steps an async run takes from groups its buffer filled early), the mean trainer / rollout busy
fractions, each repetition's speed-up over sync (both ways), and with several repetitions the
median and range of each. Extra overrides after
`--` go to every run (e.g. a GPU recipe).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def run(off_policy: int, steps: int, extra: list[str], out: Path, timeout: float | None) -> list[dict] | None:
    cmd = [
        sys.executable,
        "-m",
        "rlcore.run",
        f"steps={steps}",
        f"algo.max_off_policy_steps={off_policy}",
        f"output_dir={out}",
        "logger.console=false",
        *extra,
    ]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        # the driver is killed, its Ray processes (the engine's GPU memory, its compute) are not:
        # left, they would slow or break every later run (this machine runs nothing else of ours)
        subprocess.run(
            [sys.executable, "-m", "ray.scripts.scripts", "stop", "--force"], capture_output=True, timeout=120
        )
        print(
            f"run with max_off_policy_steps={off_policy} timed out after {timeout} s (its Ray processes "
            f"stopped):\n{(exc.stderr or b'')[-2000:]!r}",
            flush=True,
        )
        return None
    if proc.returncode != 0:
        print(f"run with max_off_policy_steps={off_policy} failed:\n{proc.stderr[-3000:]}", flush=True)
        return None
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def rate(rows: list[dict], what: str = "batch_samples") -> float:
    """Trained samples (or `what`: `loss_tokens`, completion tokens) per wall second over `rows`
    (consecutive steps)."""
    wall = rows[-1]["elapsed_s"] - rows[0]["elapsed_s"] + rows[0]["step_time_s"]
    return sum(r[what] for r in rows) / wall


def summarise(rows: list[dict], warmup: int) -> dict:
    rows = rows[warmup:]
    return {
        "samples_per_s": rate(rows),
        "steady_samples_per_s": rate(rows[len(rows) // 2 :]),
        # samples/s compares like with like only when completions are as long in both runs (a
        # random policy's lengths drift as it trains): tokens/s does either way
        "tokens_per_s": rate(rows, "loss_tokens"),
        "trainer_busy": statistics.mean(r["trainer_busy_frac"] for r in rows),
        "rollout_busy": statistics.mean(r["rollout_busy_frac"] for r in rows if r["rollout_busy_frac"] is not None),
        "max_staleness": max(r["max_staleness"] for r in rows),
        "step_time_s": statistics.mean(r["step_time_s"] for r in rows),
        "train_time_s": statistics.mean(r.get("train_time_s", float("nan")) for r in rows),
        "reward_last": rows[-1]["reward_mean"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3, help="first steps left out (start-up)")
    parser.add_argument("--off-policy", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--reps", type=int, default=1, help="repetitions of the set, interleaved")
    parser.add_argument("--out", default=None, help="keep each run's output dir under here (default: temporary)")
    parser.add_argument("--timeout", type=float, default=None, help="seconds one run may take")
    parser.add_argument("extra", nargs="*", help="overrides for every run (after --)")
    args = parser.parse_args()
    speedups: dict[int, list[float]] = {k: [] for k in args.off_policy if k}
    rates: dict[int, list[float]] = {k: [] for k in args.off_policy}
    steady: dict[int, list[float]] = {k: [] for k in args.off_policy if k}
    by_tokens: dict[int, list[float]] = {k: [] for k in args.off_policy if k}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):
            results = {}
            for k in args.off_policy:
                out = Path(args.out or tmp) / (f"rep{rep}" if args.reps > 1 else "") / f"off{k}"
                rows = run(k, args.steps, args.extra, out, args.timeout)
                if rows is None:
                    continue
                results[k] = r = summarise(rows, args.warmup)
                rates[k].append(r["samples_per_s"])
                print(
                    f"{f'rep {rep}: ' if args.reps > 1 else ''}max_off_policy_steps={k}: "
                    f"{r['samples_per_s']:.2f} samples/s (steady {r['steady_samples_per_s']:.2f}), "
                    f"{r['tokens_per_s']:.0f} completion tokens/s, trainer busy "
                    f"{r['trainer_busy']:.0%}, rollout busy {r['rollout_busy']:.0%}, max staleness "
                    f"{r['max_staleness']}, step {r['step_time_s']:.2f} s (train {r['train_time_s']:.2f} s), "
                    f"last reward {r['reward_last']:.3f}",
                    flush=True,
                )
            if 0 in results:
                for k, r in results.items():
                    if k:
                        speedups[k].append(r["samples_per_s"] / results[0]["samples_per_s"])
                        steady[k].append(r["steady_samples_per_s"] / results[0]["steady_samples_per_s"])
                        by_tokens[k].append(r["tokens_per_s"] / results[0]["tokens_per_s"])
                        print(
                            f"{f'rep {rep}: ' if args.reps > 1 else ''}speed-up of max_off_policy_steps={k} "
                            f"over sync: {speedups[k][-1]:.2f}x (steady {steady[k][-1]:.2f}x, completion "
                            f"tokens/s {by_tokens[k][-1]:.2f}x)",
                            flush=True,
                        )
    if args.reps > 1:
        for k, v in rates.items():
            if v:
                print(
                    f"max_off_policy_steps={k}: samples/s median {statistics.median(v):.2f} "
                    f"[{min(v):.2f}-{max(v):.2f}] over {len(v)} runs"
                )
        for k, v in speedups.items():
            if v:
                w, x = steady[k], by_tokens[k]
                print(
                    f"speed-up of max_off_policy_steps={k}: median {statistics.median(v):.2f}x "
                    f"[{min(v):.2f}-{max(v):.2f}] over {len(v)} pairs; steady {statistics.median(w):.2f}x "
                    f"[{min(w):.2f}-{max(w):.2f}]; completion tokens/s {statistics.median(x):.2f}x "
                    f"[{min(x):.2f}-{max(x):.2f}]"
                )


if __name__ == "__main__":
    main()
