"""Prefill/decode disaggregation and KV offload on one GPU, through rlcore's own rollout actors
(`actors.groups.place`: the `RolloutWorker`s, each decode actor's `PrefillRouter`, vLLM engines
built by `make_engine` with their pool's role) and an environment's episodes (`generate_groups`).
No trainer: the engines keep their initial weights, so both layouts serve the same policy.

Parts (`--parts`, default all):
- equal: 1 prefill + 1 decode engine (NIXL, half the GPU each): greedy episodes of the decode
  actor (each generate call prefilled on the prefill actor) against the prefill actor generating
  alone (one engine, the same weights): samples whose completion tokens are equal.
- throughput: the same concurrent requests on that pair and on one engine given the memory of
  both: samples/s and completion tokens/s of each layout.
- versions: the version rule under weight updates: rounds of `--requests` requests on the pair
  while both engines load a checkpoint `--updates` times as versions 1, 2, ... (each engine's real
  update path, as a sync lands it: `RolloutWorker.load_checkpoint_weights`, then the driver's
  release, `release_version`): every sample's first token (the prefill
  engine's version) and second (the decode engine's first step on that cache) must carry one
  version; the decode router's re-prefills and holds are counted.
- offload: one engine with a small KV cache (`--cache-gib`), the multi-turn environment at
  `--offload-concurrency` requests in flight, without and with `rollout.vllm.kv_offload_gb`:
  samples/s and the prefix-cache hit rate (vLLM's counters; the offload's hits are its
  `external_prefix_cache_*` ones).
Figures are printed (one line each, `RESULT ...`) and written to OUT/pd_rollout.json.

    python benchmarks/pd_rollout.py --out OUT [--parts equal throughput versions offload] -- [overrides]
    python benchmarks/pd_rollout.py --out OUT --share 0 --connector object_store --parts equal versions -- \
        rollout.cpus_per_actor=0.5 rollout.pd.prefill_cpus_per_actor=0.5   # a CPU check of this script
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def compose_run(overrides: list[str]):
    from rlcore.models.shipped import resolve as resolve_model
    from rlcore.plan.compose import compose

    cfg = compose(overrides)
    cfg.model = resolve_model(cfg.model)
    return cfg


def rollouts(cfg):
    """The rollout group of `cfg` placed and started (a timeout of 20 minutes for the engines)."""
    import ray

    from actors.groups import place
    from rlcore.plan.layout import run_plan

    groups = place(run_plan(cfg), trainer=False)
    ray.get([h.ready.remote() for h in groups.rollouts], timeout=1200)
    return groups


def tasks_of(cfg, n: int, offset: int = 0):
    from rlcore.envs import build_env

    env = build_env(cfg.env)
    return [env.make_task(offset + i, "train") for i in range(n)]


def run_requests(handle, cfg, requests: int, offset: int, sampling: dict | None = None) -> dict:
    """`requests` generate requests of `rollout.tasks_per_request` tasks x `algo.group_size` at
    once on `handle`; their samples, tokens and seconds."""
    import ray

    per = cfg.rollout.tasks_per_request
    start = time.perf_counter()
    refs = [
        handle.generate_groups.remote(
            tasks_of(cfg, per, offset + k * per), cfg.algo.group_size, "train", 1000 + k, sampling
        )
        for k in range(requests)
    ]
    groups = [g for gs in ray.get(refs, timeout=3600) for g in gs]
    took = time.perf_counter() - start
    samples = [s for g in groups for s in g.samples]
    failed = sum(s.failed for s in samples)
    tokens = sum(sum(s.loss_mask) for s in samples)
    return {
        "samples": len(samples),
        "failed": failed,
        "seconds": took,
        "samples_per_s": len(samples) / took,
        "tokens_per_s": tokens / took,
        "first_error": next((s.error[:300] for s in samples if s.failed), ""),
    }


def part_equal_and_throughput(args, base: list[str], out: dict, parts: list[str]) -> None:
    import ray

    def memory(share: float) -> list[str]:  # vLLM's memory share; the CPU check (--share 0) has none
        return [f"+rollout.vllm.engine_kwargs.gpu_memory_utilization={share * 0.9:.3f}"] if share else []

    half = [
        f"rollout.gpus_per_actor={args.share}",
        f"rollout.pd.prefill_gpus_per_actor={args.share}",
        *memory(args.share),
    ]
    pd = compose_run([*base, "rollout.pd.enabled=true", f"rollout.pd.connector={args.connector}", *half])
    groups = rollouts(pd)
    decode, prefill = groups.rollouts
    try:
        if "equal" in parts:
            greedy = {"temperature": 0.0}
            tasks = tasks_of(pd, args.equal_tasks)
            split, alone = ray.get(
                [
                    decode.generate_groups.remote(tasks, 2, "train", 7, greedy),
                    prefill.generate_groups.remote(tasks, 2, "train", 7, greedy),
                ],
                timeout=1800,
            )
            a = [s.completion_ids for g in split for s in g.samples]
            b = [s.completion_ids for g in alone for s in g.samples]
            equal = sum(x == y for x, y in zip(a, b))
            first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
            out["equal"] = {
                "samples": len(a),
                "equal": equal,
                "failed": sum(s.failed for g in split for s in g.samples),
                "first_unequal": None if first is None else {"split": a[first][:40], "alone": b[first][:40]},
            }
            print(
                f"RESULT pd greedy: {equal} of {len(a)} samples' completions equal to one engine's "
                f"(split path failed {out['equal']['failed']})",
                flush=True,
            )
        if "versions" in parts:
            part_versions(args, pd, decode, prefill, out)
        if "throughput" in parts:
            run_requests(decode, pd, 2, 10_000)  # warm-up (graphs, NIXL handshake)
            out["throughput_pd"] = run_requests(decode, pd, args.requests, 20_000)
            print(f"RESULT 1 prefill + 1 decode: {json.dumps(out['throughput_pd'])}", flush=True)
    finally:
        groups.remove()
    if "throughput" in parts:
        one = compose_run([*base, f"rollout.gpus_per_actor={2 * args.share}", *memory(2 * args.share)])
        groups = rollouts(one)
        try:
            run_requests(groups.rollouts[0], one, 2, 10_000)
            out["throughput_one"] = run_requests(groups.rollouts[0], one, args.requests, 20_000)
            print(f"RESULT one engine: {json.dumps(out['throughput_one'])}", flush=True)
        finally:
            groups.remove()


def part_versions(args, cfg, decode, prefill, out: dict) -> None:
    """Requests on the decode actor while both engines land updates, one after the other, until
    the requests are done (see the module docstring); RESULT: samples whose first two tokens' versions differ
    (must be 0), samples a sync overtook, updates landed, the router's counts."""
    import threading

    import ray
    import torch.distributed.checkpoint as dcp

    from rlcore.models.build import build_model
    from rlcore.models.tokenizer_build import build_tokenizer
    from rlcore.storage.checkpoint import TRAINER_DIR

    ckpt = Path(args.out) / "versions_ckpt"
    model = build_model(cfg.model, build_tokenizer(cfg.model))
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(ckpt / TRAINER_DIR), no_dist=True)
    del model
    done, landed, errors = threading.Event(), [0], []

    def updates():  # both pools at once, as a sync's collective lands on both; then the release
        try:
            for v in range(1, args.updates + 1):
                ray.get([h.load_checkpoint_weights.remote(str(ckpt), v) for h in (prefill, decode)], timeout=1200)
                ray.get(decode.release_version.remote(v), timeout=60)  # both hold it: the sync's barrier
                landed[0] = v
        except Exception as exc:  # said in the RESULT line
            errors.append(f"{type(exc).__name__}: {exc}"[:300])
        finally:
            done.set()

    thread = threading.Thread(target=updates, daemon=True)
    per, start, samples, k = cfg.rollout.tasks_per_request, time.perf_counter(), [], 0
    thread.start()
    while not done.is_set():  # rounds of requests until every update has landed among them
        refs = [
            decode.generate_groups.remote(
                tasks_of(cfg, per, 30_000 + (k + i) * per), cfg.algo.group_size, "train", 3000 + k + i
            )
            for i in range(args.requests)
        ]
        samples += [s for gs in ray.get(refs, timeout=3600) for g in gs for s in g.samples]
        k += args.requests
    thread.join(timeout=60)
    ok = [s for s in samples if not s.failed]
    # the policy's tokens only: a multi-turn sample's environment tokens carry version -1
    policy = [[v for v in s.versions if v >= 0] for s in ok]
    split = [v[:2] for v in policy if len(v) >= 2 and v[0] != v[1]]
    res = {
        "samples": len(samples),
        "failed": len(samples) - len(ok),
        "first_error": next(((s.error or "")[:300] for s in samples if s.failed), ""),
        "first_two_versions_differ": len(split),
        "examples": split[:5],
        "overtaken_by_a_sync": sum(len(set(v)) > 1 for v in policy),
        "versions_seen": sorted({v[0] for v in policy if v}),
        "updates_landed": landed[0],
        "update_errors": errors,
        "router": ray.get(decode.pd_stats.remote(), timeout=60),
        "seconds": time.perf_counter() - start,
    }
    out["versions"] = res
    print(f"RESULT pd versions: {json.dumps(res)}", flush=True)


def hit_rate(before: dict, after: dict, prefix: str) -> float | None:
    q = after.get(f"vllm:{prefix}prefix_cache_queries", 0.0) - before.get(f"vllm:{prefix}prefix_cache_queries", 0.0)
    h = after.get(f"vllm:{prefix}prefix_cache_hits", 0.0) - before.get(f"vllm:{prefix}prefix_cache_hits", 0.0)
    return h / q if q else None


def part_offload(args, base: list[str], out: dict) -> None:
    import ray

    small = [
        f"+rollout.vllm.engine_kwargs.kv_cache_memory_bytes={int(args.cache_gib * 2**30)}",
        "+rollout.vllm.engine_kwargs.disable_log_stats=false",
        "rollout.gpus_per_actor=1",
    ]
    for label, extra in (("no_offload", []), ("offload", [f"rollout.vllm.kv_offload_gb={args.offload_gib}"])):
        cfg = compose_run([*base, *small, *extra])
        groups = rollouts(cfg)
        h = groups.rollouts[0]
        try:
            run_requests(h, cfg, 2, 10_000)
            before = ray.get(h.cache_stats.remote(), timeout=60)
            res = run_requests(h, cfg, args.offload_concurrency, 20_000)
            after = ray.get(h.cache_stats.remote(), timeout=60)
            res["prefix_cache_hit_rate"] = hit_rate(before, after, "")
            res["external_prefix_cache_hit_rate"] = hit_rate(before, after, "external_")
            res["counters"] = {k: after[k] - before.get(k, 0.0) for k in after}
            out[f"offload_{label}"] = res
            print(f"RESULT {label}: {json.dumps(res)}", flush=True)
        finally:
            groups.remove()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--parts", nargs="+", default=["equal", "throughput", "versions", "offload"])
    ap.add_argument(
        "--share",
        type=float,
        default=0.45,
        help="GPU share of each engine of the pair (0: a CPU "
        "check of this script with the transformers engine: --connector object_store)",
    )
    ap.add_argument("--connector", default="nixl")
    ap.add_argument("--requests", type=int, default=16, help="concurrent requests of the throughput part")
    ap.add_argument("--equal-tasks", type=int, default=8)
    ap.add_argument("--updates", type=int, default=4, help="weight updates the versions part lands on both engines")
    ap.add_argument("--cache-gib", type=float, default=1.0, help="KV cache of the offload part's engine")
    ap.add_argument("--offload-gib", type=float, default=16.0)
    ap.add_argument("--offload-concurrency", type=int, default=32)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    from actors.session import local_ray_environment

    local_ray_environment()  # before Ray is imported: it reads these settings at import
    import ray

    from actors.session import start_ray

    out: dict = {}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    base = ["mode=eval", f"output_dir={args.out}/run", *args.overrides]
    start_ray(compose_run(base))  # as a run starts it (cluster.num_cpus / num_gpus, the actors' PYTHONPATH)
    code = 0
    try:
        if {"equal", "throughput", "versions"} & set(args.parts):
            try:
                part_equal_and_throughput(args, base, out, args.parts)
            except Exception:
                code = 1
                out["equal_throughput_error"] = traceback.format_exc()
                print(f"RESULT equal/throughput failed:\n{out['equal_throughput_error']}", flush=True)
        if "offload" in args.parts:
            try:
                part_offload(args, base, out)
            except Exception:
                code = 1
                out["offload_error"] = traceback.format_exc()
                print(f"RESULT offload failed:\n{out['offload_error']}", flush=True)
    finally:
        (Path(args.out) / "pd_rollout.json").write_text(json.dumps(out, indent=1))
        ray.shutdown()
    return code


if __name__ == "__main__":
    sys.exit(main())
