"""What reward isolation costs (issue 41), on a CPU, through the rollout actor path.

`--part actor`: three rollout actors (`ray.remote(RolloutWorker)`, the transformers engine on the
embedded tiny model, reverse_text) that differ only in how rewards run: `inline` (no deadline:
the reward called in the request's own thread, the floor), `thread` (`env.reward.isolation=thread`)
and `worker` (the default). Each repetition sends every actor the same requests (same tasks, same
seeds; the order of the actors rotates), `--concurrent` at once as the async driver does, and
times (a) the requests, driver to driver, and (b) inside the actor (`__ray_call__`), the
scoring alone: `env.score_all` of every task's answer `--group-size` times. The per-sample
overhead of a mode is its time minus inline's, per sample.

`--part hang`: whole runs, `python -m rlcore.run` for `--steps` RL steps on the CPU, with a
reward that hangs on `--hang-percent`% of tasks (`benchmarks.reward_envs.HangingReverseText`,
`env.reward.timeout_s=2`) and the same environment with no hang (clean); repetitions
alternate (with `--base DIR`, the checkout in DIR too, interleaved: before/after in one command).
Reports the RL seconds (sum of `step_time_s` in metrics.jsonl), the process seconds and ratios.

    uv run python benchmarks/reward_overhead.py --part actor --reps 15
    uv run python benchmarks/reward_overhead.py --part hang --reps 2
    uv run python benchmarks/reward_overhead.py --part hang --reps 4 --base /tmp/r3-base
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from actors.session import local_ray_environment, start_ray  # noqa: E402  (after the sys.path line above)
from rlcore.plan.compose import compose  # noqa: E402

MODES = {
    "inline": ["env.reward.timeout_s=0"],
    "thread": ["env.reward.isolation=thread"],
    "worker": ["env.reward.isolation=worker"],
}


def score_only(worker, tasks: list, group_size: int) -> float:
    """Runs inside the rollout actor: seconds of `env.score_all` for `group_size` answers per task."""
    jobs = [
        (t, [*t.messages, {"role": "assistant", "content": t.answer}], {}) for t in tasks for _ in range(group_size)
    ]
    start = time.perf_counter()
    outs = worker.env.score_all(jobs)
    seconds = time.perf_counter() - start
    assert all(o.ok and o.value == 1.0 for o in outs), [o.error for o in outs if not o.ok][:3]
    return seconds


def spread(values: list[float], scale: float = 1.0) -> str:
    v = sorted(x * scale for x in values)
    return f"{statistics.median(v):.2f} [{v[0]:.2f}-{v[-1]:.2f}]"


def actor_part(args: argparse.Namespace) -> dict:
    local_ray_environment()
    import ray

    from actors.rollout import RolloutWorker

    out_dir = tempfile.mkdtemp(prefix="reward_overhead_")
    base = [f"output_dir={out_dir}", f"algo.group_size={args.group_size}", "cluster.num_cpus=4"]
    cfgs = {m: compose(base + extra) for m, extra in MODES.items()}
    start_ray(cfgs["worker"])
    actor_cls = ray.remote(RolloutWorker)
    actors = {
        m: actor_cls.options(num_cpus=0, max_concurrency=4).remote(cfg, i) for i, (m, cfg) in enumerate(cfgs.items())
    }
    ray.get([a.ready.remote() for a in actors.values()], timeout=300)
    from rlcore.envs import build_env

    env = build_env(cfgs["worker"].env)
    n_tasks = args.tasks
    samples = n_tasks * args.group_size * args.concurrent
    request_s: dict[str, list[float]] = {m: [] for m in MODES}
    score_s: dict[str, list[float]] = {m: [] for m in MODES}
    names = list(MODES)
    for rep in range(args.reps + 1):  # repetition 0 warms up (workers forked, caches filled)
        order = names[rep % 3 :] + names[: rep % 3]
        for m in order:
            a = actors[m]
            batches = [
                [env.make_task((rep * args.concurrent + c) * n_tasks + i, "train") for i in range(n_tasks)]
                for c in range(args.concurrent)
            ]
            start = time.perf_counter()
            ray.get(
                [a.generate_meta.remote(b, args.group_size, "train", 1000 * rep + c) for c, b in enumerate(batches)],
                timeout=600,
            )
            dt = time.perf_counter() - start
            sc = sum(ray.get([a.__ray_call__.remote(score_only, b, args.group_size) for b in batches], timeout=600))
            if rep:
                request_s[m].append(dt)
                score_s[m].append(sc)
            print(f"rep {rep} {m}: requests {dt * 1e3:.1f} ms, scoring {sc * 1e3:.2f} ms", flush=True)
    ray.shutdown()
    per = 1e6 / samples
    print(
        f"\n{args.concurrent} concurrent requests x {n_tasks} tasks x {args.group_size} samples = {samples} samples "
        f"per repetition, {args.reps} repetitions; median [min-max]; load: {os.getloadavg()[0]:.2f}"
    )
    print("| mode | requests, ms | scoring in the actor, us/sample | scoring overhead vs inline, us/sample |")
    print("|---|---|---|---|")
    inline = statistics.median(score_s["inline"])
    for m in MODES:
        over = [s - inline for s in score_s[m]]
        print(f"| {m} | {spread(request_s[m], 1e3)} | {spread(score_s[m], per)} | {spread(over, per)} |")
    return {"request_s": request_s, "score_s": score_s, "samples": samples}


def hang_part(args: argparse.Namespace) -> dict:
    trees = {"now": ROOT, **({"base": os.path.abspath(args.base)} if args.base else {})}
    runs = [(tree, label, percent) for tree in trees for label, percent in (("clean", 0), ("hang", args.hang_percent))]
    results: dict[str, list[float]] = {f"{tree} {label}": [] for tree, label, _ in runs}
    process: dict[str, list[float]] = {key: [] for key in results}
    for rep in range(args.reps):
        turn = (rep + args.rotate) % len(runs)
        for tree, label, percent in runs[turn:] + runs[:turn]:  # the order rotates
            key = f"{tree} {label}"
            out_dir = tempfile.mkdtemp(prefix=f"reward_hang_{label}_")
            cmd = [
                sys.executable,
                "-m",
                "rlcore.run",
                f"output_dir={out_dir}",
                f"steps={args.steps}",
                "sft.warmup_steps=0",
                "env.name=benchmarks.reward_envs:HangingReverseText",
                f"+env.args.hang_percent={percent}",
                "env.reward.timeout_s=2",
                *args.extra,
            ]
            for _ in range(3):  # a loaded machine sometimes fails to start Ray: that run is tried again
                start = time.perf_counter()
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, check=False, cwd=trees[tree])
                wall = time.perf_counter() - start
                if "did not start" not in proc.stdout + proc.stderr:
                    break
            if proc.returncode != 0:
                raise SystemExit(f"{key} run failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
            rows = [json.loads(line) for line in open(os.path.join(out_dir, "metrics.jsonl")) if line.strip()]
            rl = sum(r.get("step_time_s") or 0.0 for r in rows if "step_time_s" in r)
            results[key].append(rl)
            process[key].append(wall)
            overdue = sum(r.get("groups_overdue") or 0 for r in rows)
            print(
                f"rep {rep} {key}: RL {rl:.1f} s over {len(rows)} rows, process {wall:.1f} s, "
                f"{rows[-1].get('samples_dropped_stale', 0)} samples dropped stale, {overdue} groups overdue "
                f"(load {os.getloadavg()[0]:.2f})",
                flush=True,
            )
    print(f"\nmedian [min-max] of {args.reps}, seconds:")
    for tree in trees:
        c, h = (statistics.median(results[f"{tree} {x}"]) for x in ("clean", "hang"))
        cp, hp = (statistics.median(process[f"{tree} {x}"]) for x in ("clean", "hang"))
        print(
            f"{tree} ({trees[tree]}): RL clean {spread(results[f'{tree} clean'])}, hang {args.hang_percent}% "
            f"{spread(results[f'{tree} hang'])}, ratio of medians {h / c:.2f}; process clean "
            f"{spread(process[f'{tree} clean'])}, hang {spread(process[f'{tree} hang'])}, ratio {hp / cp:.2f}"
        )
    return {"rl_s": results, "process_s": process}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=["actor", "hang"], required=True)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--tasks", type=int, default=8, help="tasks per request (actor part)")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--concurrent", type=int, default=2, help="requests in flight per actor (actor part)")
    p.add_argument("--steps", type=int, default=10, help="RL steps per run (hang part)")
    p.add_argument("--hang-percent", type=int, default=30)
    p.add_argument(
        "--rotate",
        type=int,
        default=0,
        help="hang part: start the rotation of run orders here (split a long measurement into shorter commands)",
    )
    p.add_argument(
        "--base",
        help="hang part: also run the checkout in this directory (e.g. a `git worktree add` "
        "of the code before), interleaved with this one",
    )
    p.add_argument("--out", help="write the repetitions as JSON here")
    p.add_argument("extra", nargs="*", help="more overrides for the runs (hang part)")
    args = p.parse_args()
    res = actor_part(args) if args.part == "actor" else hang_part(args)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
