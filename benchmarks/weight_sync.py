"""Weight-sync wall time and effective bandwidth, trainer GPU -> vLLM engine GPU, over NCCL.

Needs 2 GPUs and vLLM. For each model shape: a trainer-like process on GPU 0 (random-weight
transformers model, bf16), a VLLMEngine on GPU 1 (dummy weights, eager). Each repetition: the
trainer takes a fake step (noise on every weight), then trainer send and engine receive run
concurrently. Timed: "trainer step done" (after its CUDA sync) -> ``receive_weights`` returned
(the engine serves the new weights). A canary (engine vs trainer teacher-forced logprobs,
4 x 16 tokens) runs after every sync, outside the timed span.

    PYTHONPATH=$PWD python benchmarks/weight_sync.py [--models qwen3-0.6b,qwen3-4b] [--reps 5]

Prints one table row per (model, receive path) and writes JSON with --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.harness import TrainerProc, canary, connect, step_and_sync, write_model_dir  # noqa: E402

# (label, reload, fast_pause, kv_on_update): vLLM's native layerwise reload through the public
# pause API (the path the design names), the same with the engine-core pause, and the direct
# receive (recorded loader replayed as batched copies, no pause), plus the direct receive under a
# cache-clearing pause (kv_on_update="recompute") to show what the pause costs.
CONFIGS = [
    ("layerwise+pause_generation", "layerwise", False, "keep"),
    ("layerwise", "layerwise", True, "keep"),
    ("direct+recompute", "direct", True, "recompute"),
    ("direct", "direct", True, "keep"),
]


def run_model(shape: str, reps: int, bucket_mb: int, nbuf: int) -> list[dict]:
    from rlcore.engine.vllm.vllm_engine import VLLMEngine
    from rlcore.weights.canary import canary_prompts

    model_dir = write_model_dir(shape)
    trainer = TrainerProc(model_dir, gpu="0")
    os.environ["CUDA_VISIBLE_DEVICES"] = "1"
    t = time.perf_counter()
    engine = VLLMEngine(
        model_dir,
        load_format="dummy",
        enforce_eager=True,
        gpu_memory_utilization=0.5,
        max_model_len=2048,
        rpc_timeout_s=300,
    )
    print(f"[{shape}] engine up in {time.perf_counter() - t:.1f} s", flush=True)
    rows = []
    try:
        trainer.wait_ready()
        connect(engine, trainer)
        info = trainer.call("update_info", bucket_mb * 2**20, nbuf)
        gb = trainer.nbytes / 1e9
        pairs = canary_prompts(151936)
        before = canary(engine, trainer, pairs)
        print(
            f"[{shape}] {trainer.num_tensors} tensors, {gb:.3f} GB; before any sync (dummy weights): "
            f"{before.describe()}",
            flush=True,
        )
        version, step = 0, 0
        for label, reload, fast, kv in CONFIGS:
            engine.reload, engine.fast_pause, engine.kv_on_update = reload, fast, kv
            samples, gaps = [], []
            for r in range(reps + 1):  # the first one warms up (allocator, NCCL channels)
                step += 1
                version += 1
                times = step_and_sync(engine, trainer, info, version, seed=step)
                gap = canary(engine, trainer, pairs)
                if r > 0:
                    samples.append(times)
                    gaps.append(gap.max_gap)
                if not gap.passed:
                    print(f"[{shape}/{label}] CANARY FAILED: {gap.describe()}", flush=True)
            e2e = [s["e2e_s"] for s in samples]
            med = statistics.median(e2e)
            keys = sorted({k for s in samples for k in s if k.endswith("_s")})
            breakdown = {k: statistics.median(s.get(k, float("nan")) for s in samples) for k in keys}
            row = dict(
                model=shape,
                path=label,
                gb=gb,
                reps=reps,
                e2e_median_s=med,
                e2e_min_s=min(e2e),
                e2e_max_s=max(e2e),
                gbps_median=gb / med,
                canary_max_gap=max(gaps),
                breakdown=breakdown,
                bucket_mb=bucket_mb,
                num_buffers=nbuf,
            )
            rows.append(row)
            print(
                f"[{shape}/{label}] e2e median {med * 1e3:.1f} ms (min {min(e2e) * 1e3:.1f}, max "
                f"{max(e2e) * 1e3:.1f}) -> {gb / med:.1f} GB/s; canary max gap {max(gaps):.4f}; breakdown "
                + ", ".join(f"{k}={v * 1e3:.1f}ms" for k, v in breakdown.items()),
                flush=True,
            )
        step += 1
        step_and_sync(engine, trainer, info, version, seed=step, send=False)
        stale = canary(engine, trainer, pairs)
        print(
            f"[{shape}] stale weights (trainer stepped, no sync): {stale.describe()} -> "
            f"{'FAILS as it should' if not stale.passed else 'PASSES (bad)'}",
            flush=True,
        )
        for row in rows:
            row["stale_canary_max_gap"] = stale.max_gap
    finally:
        engine.shutdown()
        trainer.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="qwen3-0.6b,qwen3-4b")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--bucket-mb", type=int, default=512)
    ap.add_argument("--num-buffers", type=int, default=2)
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args()
    rows = []
    for shape in args.models.split(","):
        rows += run_model(shape, args.reps, args.bucket_mb, args.num_buffers)
    print("\n| model | receive path | GB | e2e median ms (min-max) | effective GB/s | canary max gap |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['model']} | {r['path']} | {r['gb']:.2f} | {r['e2e_median_s'] * 1e3:.1f} "
            f"({r['e2e_min_s'] * 1e3:.1f}-{r['e2e_max_s'] * 1e3:.1f}) | {r['gbps_median']:.1f} | "
            f"{r['canary_max_gap']:.3f} |"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
