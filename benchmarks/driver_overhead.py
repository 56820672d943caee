"""What the RL driver itself costs per sample and per step, with synthetic groups (no engine).

The driver keeps ObjectRefs plus per-sample metadata; it never deserialises token data on the RL
path (`actors/rollout_refs.py`). Each step it does (`actors/driver.py`):

1. `collect`: `ray.get` of each finished generate request's return 0 (its groups' metadata,
   `list[SampleMeta]` per group; returns 1..n, each group's `list[Sample]`, stay in the object
   store as refs the driver owns), then `RolloutBuffer.add` per group;
2. `pop_batch`: the batch leaves the buffer;
3. `build_step` (`rlcore/batch/step.py`): advantages, the token-balanced packing plan, the loss
   normaliser and the batch metrics, from metadata alone;
4. `dispatch`: serialising each data-parallel rank's `RankWork` (refs, sample picks,
   advantages, micro-batch bins) into the object store, as a `train_step.remote` does with it.

This script runs exactly those functions on requests made by a Ray task in another process
(one object per group's token data, as `generate_stream` sends them), and reports the seconds of each part,
per step and per sample. One driver can feed `samples/s per GPU` GPUs only while its own
samples/s (1 / seconds per sample) stays above the GPUs' total. `rank_fetch_pack_s` is not the
driver's cost: it is what trainer rank 0 then spends (in its own process) fetching its samples'
token data and packing its micro-batches (`rlcore.batch.step.rank_micro_batches`).

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

from actors.session import local_ray_environment, start_ray
from rlcore.plan.compose import compose

local_ray_environment()  # what `python -m rlcore.run` sets before Ray is imported

import ray  # noqa: E402

from rlcore.batch.buffer import Accounting, RolloutBuffer  # noqa: E402
from rlcore.batch.meta import samples_meta  # noqa: E402
from rlcore.batch.step import RankWork, build_step, rank_micro_batches  # noqa: E402
from rlcore.types import GroupMeta, Sample, Task  # noqa: E402


def request_groups(reply: tuple, tasks: list[Task], data: list, request_id: int, indices: list[int]) -> list[GroupMeta]:
    """The driver's groups of one request (`reply`: its metadata, `data`: its token-data refs),
    as `actors.rollout_stream.Stream.read` makes them."""
    metas, stats = reply
    return [
        GroupMeta(task=t, samples=m, data=d, request_id=request_id, stream_index=i, env_stats=stats)
        for t, m, d, i in zip(tasks, metas, data, indices)
    ]


@ray.remote
def make_request(groups: int, group_size: int, prompt_len: int, completion_len: int, vocab: int, seed: int) -> tuple:
    """One generate request's reply (call with `num_returns=1 + groups`): the metadata, then each
    group's samples (the objects `RolloutWorker.generate_stream` streams, one ref per group) (random token ids,
    logprobs, rewards and completion lengths)."""
    rng = random.Random(seed)
    data = []
    for _ in range(groups):
        prompt = [rng.randrange(vocab) for _ in range(prompt_len)]
        samples = []
        for _ in range(group_size):
            n = rng.randint(max(1, completion_len // 2), completion_len)
            samples.append(
                Sample(
                    prompt,
                    [rng.randrange(vocab) for _ in range(n)],
                    [-rng.random() for _ in range(n)],
                    [0] * n,
                    [1] * n,
                    finish_reason="stop",
                    reward=float(rng.random() < 0.5),
                )
            )
        data.append(samples)
    return ([samples_meta(d) for d in data], {}), *data


@ray.remote
def rank_side(work: RankWork, timeout_s: float) -> float:
    """What a trainer rank does before its forward passes: fetch its groups, pack its micro-batches."""
    start = time.perf_counter()
    rank_micro_batches(work, ray.get(work.data, timeout=timeout_s))
    return time.perf_counter() - start


def measure(samples: int, args) -> dict:
    groups = samples // args.group_size
    cfg = compose(
        [
            f"algo.group_size={args.group_size}",
            f"algo.batch_groups={groups}",
            f"trainer.world_size={args.dp}",
            f"trainer.micro_batch_tokens={args.micro_batch_tokens}",
            f"rollout.sampling.max_new_tokens={args.completion_len}",
        ]
    )
    per_request = args.tasks_per_request
    requests = []
    for first in range(0, groups, per_request):
        n = min(per_request, groups - first)
        refs = make_request.options(num_returns=1 + n).remote(
            n, args.group_size, args.prompt_len, args.completion_len, 32000, first
        )
        tasks = [Task(id=f"t{first + g}", messages=[{"role": "user", "content": "x"}]) for g in range(n)]
        requests.append((refs[0], list(refs[1:]), tasks, list(range(first, first + n))))
    every = [r for req in requests for r in [req[0], *req[1]]]
    ray.wait(every, num_returns=len(every), timeout=3600, fetch_local=False)  # generation is not the driver's cost
    acct = Accounting()
    buffer = RolloutBuffer(0, groups + 1, acct)
    buffer.launched(groups * args.group_size)
    t0 = time.perf_counter()
    fetched = [
        request_groups(ray.get(meta, timeout=600), tasks, data, seq, indices)  # one call per request
        for seq, (meta, data, tasks, indices) in enumerate(requests)
    ]
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
    work_refs = [ray.put(work) for work in step.ranks]
    t5 = time.perf_counter()
    times = {
        "ray_get_s": t1 - t0,
        "buffer_add_s": t2 - t1,
        "pop_batch_s": t3 - t2,
        "build_step_s": t4 - t3,
        "dispatch_s": t5 - t4,
    }
    total = t5 - t0
    rank_s = ray.get(rank_side.remote(step.ranks[0], 600), timeout=600)
    tokens = sum(s.num_tokens for g in batch for s in g.samples)
    del fetched, batch, step, work_refs, requests, every
    gc.collect()
    return {
        "samples": groups * args.group_size,
        "tokens": tokens,
        "requests": -(-groups // per_request),
        **times,
        "total_s": total,
        "per_sample_us": total / (groups * args.group_size) * 1e6,
        "driver_samples_per_s": groups * args.group_size / total,
        "rank_fetch_pack_s": rank_s,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, nargs="+", default=[1000, 10000, 100000])
    p.add_argument("--reps", type=int, default=3, help="repetitions per size (the median is reported)")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument(
        "--tasks-per-request", type=int, default=4, help="groups per generate request (rollout.tasks_per_request)"
    )
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument(
        "--completion-len", type=int, default=256, help="longest completion; lengths are uniform in [n/2, n]"
    )
    p.add_argument("--dp", type=int, default=8, help="trainer data-parallel ranks (shards per step)")
    p.add_argument("--micro-batch-tokens", type=int, default=16384)
    p.add_argument(
        "--gpu-samples-per-s",
        type=float,
        default=41.0,
        help="samples/s one GPU produces and trains end to end (docs/benchmarks.md, issue 3/4 run 2: "
        "82.2 samples/s on 2 GPUs, Qwen3-0.6B shape)",
    )
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
