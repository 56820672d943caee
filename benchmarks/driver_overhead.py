"""What the RL driver itself costs per sample and per step, with synthetic groups (no engine).

The driver does four things with rollout data each step (`actors/driver.py`):

1. `collect`: `ray.get` of each finished generate request (the groups a rollout actor returned,
   deserialised in the driver process), then `RolloutBuffer.add` per group;
2. `pop_batch`: the batch leaves the buffer;
3. `build_step` (`rlcore/step.py`): advantages, token-balanced packing into one shard per
   data-parallel rank, the loss normaliser and the batch metrics;
4. `ray.put` of each shard (every trainer rank fetches its own from the object store).

This script runs exactly those functions on groups made by a Ray task in another process (so
the `ray.get` pays the same deserialisation as a rollout actor's reply) and reports the seconds
of each part, per step and per sample. One driver can feed `samples/s per GPU` GPUs only while
its own samples/s (1 / seconds per sample) stays above the GPUs' total.

    uv run python benchmarks/driver_overhead.py --samples 1000 10000 100000 --out driver_overhead.json
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import resource
import statistics
import time

from rlcore.run import compose, local_ray_environment, start_ray

local_ray_environment()  # what `python -m rlcore.run` sets before Ray is imported

import ray  # noqa: E402

from rlcore.buffer import Accounting, RolloutBuffer  # noqa: E402
from rlcore.step import build_step  # noqa: E402
from rlcore.trainer.parallel import shards_per_rank  # noqa: E402
from rlcore.types import Group, Sample, Task  # noqa: E402


@ray.remote
def make_request(first: int, groups: int, group_size: int, prompt_len: int, completion_len: int,
                 vocab: int, seed: int) -> list[Group]:
    """One generate request's reply, as a rollout actor returns it: `groups` groups of
    `group_size` samples with random token ids, logprobs, rewards and completion lengths."""
    rng = random.Random(seed)
    out = []
    for g in range(groups):
        prompt = [rng.randrange(vocab) for _ in range(prompt_len)]
        samples = []
        for _ in range(group_size):
            n = rng.randint(max(1, completion_len // 2), completion_len)
            samples.append(Sample(prompt, [rng.randrange(vocab) for _ in range(n)],
                                  [-rng.random() for _ in range(n)], [0] * n, [1] * n,
                                  finish_reason="stop", reward=float(rng.random() < 0.5)))
        out.append(Group(task=Task(id=f"t{first + g}", messages=[{"role": "user", "content": "x"}]),
                         samples=samples, stream_index=first + g))
    return out


def measure(samples: int, args) -> dict:
    groups = samples // args.group_size
    cfg = compose([f"algo.group_size={args.group_size}", f"algo.batch_groups={groups}",
                   f"trainer.world_size={args.dp}", f"trainer.micro_batch_tokens={args.micro_batch_tokens}",
                   f"rollout.sampling.max_new_tokens={args.completion_len}"])
    per_request = args.tasks_per_request
    refs = [make_request.remote(i, min(per_request, groups - i), args.group_size, args.prompt_len,
                                args.completion_len, 32000, i) for i in range(0, groups, per_request)]
    ray.wait(refs, num_returns=len(refs), timeout=3600, fetch_local=False)  # generation is not the driver's cost
    acct = Accounting()
    buffer = RolloutBuffer(0, groups + 1, acct)
    buffer.launched(groups * args.group_size)
    times = {}
    t0 = time.perf_counter()
    fetched = [ray.get(ref, timeout=600) for ref in refs]  # one call per finished request, as `collect`
    t1 = time.perf_counter()
    for request in fetched:
        for group in request:
            buffer.add(group)
    t2 = time.perf_counter()
    batch = buffer.pop_batch(0, groups)
    batch.sort(key=lambda g: g.stream_index)
    t3 = time.perf_counter()
    step = build_step(batch, cfg)
    t4 = time.perf_counter()
    shard_refs = shards_per_rank([ray.put(shard) for shard in step.shards], cfg.trainer)
    t5 = time.perf_counter()
    times = {"ray_get_s": t1 - t0, "buffer_add_s": t2 - t1, "pop_batch_s": t3 - t2, "build_step_s": t4 - t3,
             "ray_put_s": t5 - t4}
    total = t5 - t0
    tokens = sum(len(s.prompt_ids) + len(s.completion_ids) for g in batch for s in g.samples)
    del fetched, batch, step, shard_refs, refs
    gc.collect()
    return {"samples": groups * args.group_size, "tokens": tokens, "requests": -(-groups // per_request),
            **times, "total_s": total, "per_sample_us": total / (groups * args.group_size) * 1e6,
            "driver_samples_per_s": groups * args.group_size / total}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, nargs="+", default=[1000, 10000, 100000])
    p.add_argument("--reps", type=int, default=3, help="repetitions per size (the median is reported)")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--tasks-per-request", type=int, default=4, help="groups per generate request (rollout.tasks_per_request)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--completion-len", type=int, default=256, help="longest completion; lengths are uniform in [n/2, n]")
    p.add_argument("--dp", type=int, default=8, help="trainer data-parallel ranks (shards per step)")
    p.add_argument("--micro-batch-tokens", type=int, default=16384)
    p.add_argument("--gpu-samples-per-s", type=float, default=41.0,
                   help="samples/s one GPU produces and trains end to end (docs/benchmarks.md, issue 3/4 run 2: "
                        "82.2 samples/s on 2 GPUs, Qwen3-0.6B shape)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    start_ray(compose(["cluster.num_cpus=2"]))  # the run's own local Ray start
    rows = []
    for n in args.samples:
        reps = [measure(n, args) for _ in range(args.reps if n < 100000 else 1)]
        row = {k: statistics.median(r[k] for r in reps) for k in reps[0]}
        row["reps"] = len(reps)
        row["gpus_fed"] = row["driver_samples_per_s"] / args.gpu_samples_per_s
        rows.append(row)
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"driver peak RSS: {peak:.2f} GiB")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "rows": rows, "peak_rss_gib": peak}, f, indent=2)
    ray.shutdown()


if __name__ == "__main__":
    main()
