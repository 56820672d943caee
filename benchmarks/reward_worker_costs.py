"""What the reward worker's isolation of issue 41 costs a cheap reward, A/B in one process.

Variants, interleaved per repetition, each a fresh `WorkerPool` (2 workers, forked from this
process, not started by a zygote: the variants patch this process) of a reverse_text environment
in this process with the rollout actor's imports (torch, transformers, ray: ~2000 modules):

- `full`: today's workers (own PID namespace, every piece of process state restored per call);
- `no_namespace`: the same, the workers in this process's PID namespace (`reward_worker_ns.enter`
  returns NONE);
- `light_restore`: the same, restoring only the working directory, `os.environ`, `sys.path` and
  alarms after each call (what workers restored before);
- `no_journal`: `full` without the module journal (modules keep their class: attribute loads on
  them stay specialised).

Reported per variant: the first request (workers forked, `--calls` calls) and the median of the
next `--requests` requests (warm workers), in ms, median and range over `--reps` repetitions.

    uv run python benchmarks/reward_worker_costs.py --reps 7
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: F401  (the modules a rollout actor has: what the journal and checks walk)
import transformers  # noqa: F401

import actors.rollout  # noqa: F401
from rlcore.envs.reverse_text import ReverseText
from rlcore.isolation import reward_worker_home, reward_worker_ns
from rlcore.isolation.reward_workers import WorkerPool

FULL_RESTORE = reward_worker_home.Home.restore
FULL_ENTER = reward_worker_ns.enter
FULL_JOURNAL = reward_worker_home._journal_modules


def light_restore(self) -> None:
    signal.alarm(0)
    if os.getcwd() != self.cwd:
        os.chdir(self.cwd)
    if reward_worker_home._raw(os.environ) != self.raw_environ:
        os.environ.clear()
        os.environ.update(self.environ)
    if sys.path != self.lists[0][1]:
        sys.path[:] = self.lists[0][1]


VARIANTS = {
    "full": (FULL_RESTORE, FULL_ENTER),
    "no_namespace": (FULL_RESTORE, lambda: reward_worker_ns.NONE),
    "light_restore": (light_restore, FULL_ENTER),
    "no_journal": (FULL_RESTORE, FULL_ENTER),
}


def one(env, variant: str, calls: int, requests: int) -> tuple[float, float]:
    restore, enter = VARIANTS[variant]
    reward_worker_home.Home.restore, reward_worker_ns.enter = restore, enter  # inherited by the fork
    if variant == "no_journal":
        reward_worker_home._journal_modules = lambda modules: None
    tasks = [env.make_task(i, "train") for i in range(calls)]
    batch = [(env.reward, (t, t.answer)) for t in tasks]
    pool = WorkerPool(env, 2, zygote=False)  # the variants are patches of this process: forks inherit them
    try:
        times = []
        for _ in range(requests + 1):
            start = time.perf_counter()
            outs = pool.call_many(batch, 10.0)
            times.append(time.perf_counter() - start)
            assert all(o.ok and o.value == 1.0 for o in outs), [o.error for o in outs][:3]
    finally:
        pool.close()
        reward_worker_home.Home.restore, reward_worker_ns.enter = FULL_RESTORE, FULL_ENTER
        reward_worker_home._journal_modules = FULL_JOURNAL
    return times[0], statistics.median(times[1:])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--calls", type=int, default=64, help="reward calls per request")
    p.add_argument("--requests", type=int, default=20, help="warm requests per repetition")
    args = p.parse_args()
    env = ReverseText()
    got: dict[str, list[tuple[float, float]]] = {v: [] for v in VARIANTS}
    names = list(VARIANTS)
    for rep in range(args.reps):
        for v in names[rep % len(names) :] + names[: rep % len(names)]:  # rotate the order
            got[v].append(one(env, v, args.calls, args.requests))
    print(f"{len(sys.modules)} modules; {args.calls} calls a request; load {os.getloadavg()[0]:.1f}")
    for v, runs in got.items():
        first = sorted(r[0] * 1e3 for r in runs)
        warm = sorted(r[1] * 1e3 for r in runs)
        print(
            f"{v:14s} first request {statistics.median(first):7.2f} ms [{first[0]:.2f}-{first[-1]:.2f}]   "
            f"warm request {statistics.median(warm):6.2f} ms [{warm[0]:.2f}-{warm[-1]:.2f}]   "
            f"per call {statistics.median(warm) / args.calls * 1e3:5.1f} us"
        )


if __name__ == "__main__":
    main()
