"""What a storm of overrunning rewards costs the rollout actor's reward pool, in one process with a
rollout actor's imports (torch, transformers, ray) and a 30 MB model built from a config (issue 41).

`--part starts`: `--workers` worker starts in a row, from the pool's zygote (a lean interpreter,
:mod:`rlcore.isolation.reward_zygote`) and as forks of this process (what a pool does while its
zygote starts, and where the environment does not pickle), interleaved per repetition. Reports
the wall time of the starts, this process's CPU time in them (what the actor's engine thread
loses: a fork holds the GIL) and the CPU time of the processes started (keepers, workers, the
zygote), median and range over `--reps`.

`--part settle`: `--requests` requests of 8 tasks x 8 samples (`HangingReverseText`, 30% of
tasks hang until the 2 s deadline), started 0.25 s apart in threads as the actor's request
threads do; how long after its request started each call of a task that does not hang settled
(median, 90th percentile, max, and how many after 0.5 s and 1.5 s). Measures the checkout it is
run from (the current directory), so a `git worktree` of another commit gives the before:

    uv run python benchmarks/reward_worker_starts.py --part starts --reps 5
    uv run python benchmarks/reward_worker_starts.py --part settle
    (cd /tmp/base && uv run --project /work/main python /work/main/benchmarks/reward_worker_starts.py --part settle)
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import threading
import time
import zlib

sys.path.insert(0, os.getcwd())

import ray  # noqa: F401,E402  (the imports of a rollout actor: what makes its forks dear)
import torch  # noqa: F401,E402
import transformers  # noqa: E402

from benchmarks.reward_envs import HangingReverseText  # noqa: E402
from rlcore.config.reward import RewardRuntimeConfig  # noqa: E402
from rlcore.isolation.reward_workers import WorkerPool  # noqa: E402


def cpu(who: int) -> float:
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime


def spread(values: list[float], fmt: str = "{:.3f}") -> str:
    return f"{fmt.format(statistics.median(values))} [{fmt.format(min(values))}-{fmt.format(max(values))}]"


def starts(args: argparse.Namespace) -> None:
    env = HangingReverseText(hang_percent=0)
    figures: dict[str, dict[str, list[float]]] = {}
    for rep in range(args.reps):
        for how in ["zygote", "fork"] if rep % 2 == 0 else ["fork", "zygote"]:
            pool = WorkerPool(env, 2, zygote=how == "zygote")
            if how == "zygote":
                until = time.monotonic() + 60
                while pool.zygote() is None:
                    if time.monotonic() > until:
                        raise SystemExit("the zygote did not start within 60 s")
                    time.sleep(0.01)
            own0, kids0, t0 = cpu(resource.RUSAGE_SELF), cpu(resource.RUSAGE_CHILDREN), time.perf_counter()
            workers = [pool.take() for _ in range(args.workers)]
            while any(w.pidfd is None for w in workers):  # started: its keeper sent its pidfd
                for w in workers:
                    w._signal(0)
                time.sleep(0.001)
            wall, own = time.perf_counter() - t0, cpu(resource.RUSAGE_SELF) - own0
            for w in workers:
                pool.give(w)
            pool.close()  # reaps the keepers (and the zygote): their CPU time is counted as children's
            kids = cpu(resource.RUSAGE_CHILDREN) - kids0
            got = figures.setdefault(how, {"wall": [], "own": [], "kids": []})
            got["wall"].append(wall)
            got["own"].append(own)
            got["kids"].append(kids)
            print(
                f"rep {rep} {how}: {args.workers} starts in {wall:.3f} s, this process {own:.3f} s CPU, "
                f"the processes started {kids:.3f} s CPU",
                flush=True,
            )
    print(f"\nmedian [min-max] of {args.reps}, seconds, {args.workers} worker starts:")
    for how, got in figures.items():
        print(
            f"{how}: wall {spread(got['wall'])}, this process CPU {spread(got['own'])}, "
            f"started processes CPU {spread(got['kids'])}"
        )


def settle(args: argparse.Namespace) -> None:
    env = HangingReverseText(hang_percent=30, reward_runtime=RewardRuntimeConfig(timeout_s=2.0))
    pool = env.reward_pool()
    lags: list[float] = []
    lock = threading.Lock()

    def request(r: int) -> None:
        tasks = [env.make_task(r * 8 + i, "train") for i in range(8)]
        calls = [(env.reward, (t, "x")) for t in tasks for _ in range(8)]
        hangs = [zlib.crc32(t.id.encode()) % 100 < 30 for t in tasks for _ in range(8)]
        t0 = time.monotonic()
        for i, _ in pool.stream_many(calls, env.reward_runtime.timeout_s):
            if not hangs[i]:
                with lock:
                    lags.append(time.monotonic() - t0)

    threads = []
    for r in range(args.requests):
        threads.append(threading.Thread(target=request, args=(r,)))
        threads[-1].start()
        time.sleep(0.25)
    for t in threads:
        t.join()
    pool.close()
    lags.sort()
    print(
        f"{os.getcwd()}: {len(lags)} calls that do not hang settled after: median {statistics.median(lags):.3f} s, "
        f"p90 {lags[int(0.9 * len(lags))]:.3f} s, max {lags[-1]:.3f} s; after 0.5 s: "
        f"{sum(x > 0.5 for x in lags)}, after 1.5 s: {sum(x > 1.5 for x in lags)}"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=["starts", "settle"], required=True)
    p.add_argument("--reps", type=int, default=5, help="starts: repetitions")
    p.add_argument("--workers", type=int, default=50, help="starts: workers started in a row")
    p.add_argument("--requests", type=int, default=12, help="settle: requests")
    args = p.parse_args()
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.LlamaConfig(  # held, as the actor holds one
            hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4, vocab_size=32000
        )
    )
    (starts if args.part == "starts" else settle)(args)
    del model


if __name__ == "__main__":
    main()
