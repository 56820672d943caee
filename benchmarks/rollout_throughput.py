"""Rollout output tokens/s: VLLMEngine.generate vs raw ``vllm.LLM.generate`` on the same work.

Same model (random-weight Qwen3 shape, dummy weights), same engine settings (bf16, CUDA graphs
unless --eager, ``logprobs_mode=processed_logprobs``, max_num_seqs / max_num_batched_tokens
pinned: vLLM's defaults differ between LLM and AsyncLLM), same prompts (seeded random token ids)
and sampling (temperature, top-p, per-token logprob of the sampled token, ignore_eos so every
sample has exactly --max-tokens tokens). One GPU holding both engines; repetitions alternate.

    PYTHONPATH=$PWD python benchmarks/rollout_throughput.py [--prompts 256 --prompt-len 128 --max-tokens 256]

``--quant-compare fp8`` measures VLLMEngine only, first in bf16 and then with vLLM's online FP8
quantization (``quantization="fp8"``: e4m3 weights with a per-tensor scale, dynamic per-token
activation scales, KV cache and lm_head in bf16), and prints the FP8 / bf16 speedup:

    PYTHONPATH=$PWD python benchmarks/rollout_throughput.py --model qwen3-4b --quant-compare fp8 --out r.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.harness import write_model_dir  # noqa: E402


def fresh_batch(prompts: list[list[int]], rep: int) -> list[list[int]]:
    """Repetition ``rep``'s prompts: new token ids, so the prefix cache helps no repetition."""
    return [[(tok + 7919 * (rep + 1)) % 150000 + 1000 for tok in p] for p in prompts]


def start_engine(model_dir: str, label: str, **engine_args):
    from rlcore.engine.vllm.vllm_engine import VLLMEngine

    t = time.perf_counter()
    engine = VLLMEngine(model_dir, extra_sampling={"ignore_eos": True}, **engine_args)
    print(f"{label}: VLLMEngine up in {time.perf_counter() - t:.1f} s", flush=True)
    return engine


def engine_tokens(engine, batch: list[list[int]], sp) -> int:
    """Output tokens of one ``VLLMEngine.generate`` over ``batch`` (checking the per-token lists)."""
    gens = engine.generate(batch, sp)
    assert all(len(g.logprobs) == len(g.token_ids) == len(g.versions) for g in gens)
    return sum(len(g.token_ids) for g in gens)


def record(
    results: dict[str, list[float]], label: str, rep: int, ntok: int, dt: float, cpu: float | None = None
) -> None:
    """One repetition's tok/s into ``results[label]``; ``cpu``: this (client) process's CPU
    seconds during it, into ``results[label + " cpu_s"]`` (the engine core is another process)."""
    results.setdefault(label, []).append(ntok / dt)
    extra = ""
    if cpu is not None:
        results.setdefault(f"{label} cpu_s", []).append(cpu)
        extra = f", client CPU {cpu:.3f} s"
    print(f"{label} rep {rep}: {ntok} tokens in {dt:.3f} s = {ntok / dt:.0f} tok/s{extra}", flush=True)


def report(
    args: argparse.Namespace,
    results: dict[str, list[float]],
    title: str,
    rows: dict[str, str],
    pair: tuple[str, str],
    key: str,
    ratio_text: str,
    suffix: str = "",
) -> None:
    """Print the median tok/s of each ``rows`` label (name in the table -> key in ``results``)
    and the ratio ``pair[0] / pair[1]`` of two medians; with ``--out`` also write all repetitions
    and that ratio (under ``key``) as JSON."""
    med = {k: statistics.median(v) for k, v in results.items()}
    print(f"\n| {title} | output tok/s (median of {args.reps}) |\n|---|---|")
    for name, label in rows.items():
        print(f"| {name} | {med[label]:.0f} |")
    ratio = med[pair[0]] / med[pair[1]]
    print(f"{ratio_text} = {ratio:.3f}{suffix}")
    a, b = results[pair[0]], results[pair[1]]
    print(
        f"ratio of means {statistics.mean(a) / statistics.mean(b):.3f}, median of per-repetition ratios "
        f"{statistics.median(x / y for x, y in zip(a, b)):.3f}"
    )
    for label in pair:
        if f"{label} cpu_s" in results:
            print(f"{label}: client process CPU per repetition, median {med[label + ' cpu_s']:.3f} s")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "tok_s": results, key: ratio}, f, indent=1)


def time_engine(
    model_dir: str,
    prompts: list[list[int]],
    args: argparse.Namespace,
    label: str,
    results: dict[str, list[float]],
    **engine_args,
) -> None:
    """Output tok/s of VLLMEngine.generate for each of ``args.reps`` fresh prompt sets, into
    ``results[label]``."""
    from rlcore.engine.base import SamplingParams

    engine = start_engine(model_dir, label, **engine_args)
    sp = SamplingParams(max_new_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p)
    try:
        engine.generate(prompts[:32], SamplingParams(max_new_tokens=32))  # warm-up
        for r in range(args.reps):
            batch = fresh_batch(prompts, r)
            t = time.perf_counter()
            ntok = engine_tokens(engine, batch, sp)
            record(results, label, r, ntok, time.perf_counter() - t)
    finally:
        engine.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs / torch.compile")
    ap.add_argument("--gpu", default="1")
    ap.add_argument("--out", default=None)
    ap.add_argument("--quantization", default=None, help="vLLM quantization for both engines (e.g. fp8)")
    ap.add_argument(
        "--quant-compare",
        default=None,
        metavar="QUANT",
        help="VLLMEngine only: bf16 vs this quantization (e.g. fp8); prints the speedup",
    )
    args = ap.parse_args()
    os.environ["CUDA_VISIBLE_DEVICES"] = args.gpu

    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 150000) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
    model_dir = write_model_dir(args.model)
    common = dict(
        load_format="dummy",
        dtype="bfloat16",
        enforce_eager=args.eager,
        gpu_memory_utilization=0.4,
        max_model_len=args.prompt_len + args.max_tokens + 16,
        max_num_seqs=args.prompts,
        max_num_batched_tokens=16384,
        seed=0,
        enable_prefix_caching=True,
    )
    if args.quantization:
        common["quantization"] = args.quantization
    results: dict[str, list[float]] = {}

    if args.quant_compare:
        common.pop("quantization", None)
        for label, quant in (("bf16", None), (args.quant_compare, args.quant_compare)):
            time_engine(model_dir, prompts, args, label, results, quantization=quant, **common)
        q = args.quant_compare
        report(
            args,
            results,
            f"{args.model} VLLMEngine",
            {"bf16": "bf16", q: q},
            (q, "bf16"),
            "speedup",
            f"speedup {q} / bf16",
        )
        return

    # Both engines live on the same GPU at once and the repetitions alternate between them, so
    # drift over the run (clocks, other tenants of the host) hits both sides alike.
    from vllm import LLM
    from vllm import SamplingParams as VSamplingParams
    from vllm.inputs import TokensPrompt

    from rlcore.engine.base import SamplingParams

    engine = start_engine(model_dir, "VLLMEngine", **common)
    sp = SamplingParams(max_new_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p)
    try:
        t = time.perf_counter()
        llm = LLM(
            model_dir, skip_tokenizer_init=True, logprobs_mode="processed_logprobs", disable_log_stats=True, **common
        )
        print(f"vllm.LLM up in {time.perf_counter() - t:.1f} s", flush=True)
        vsp = VSamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            logprobs=0,
            flat_logprobs=True,
            ignore_eos=True,
            detokenize=False,
        )
        engine.generate(prompts[:32], SamplingParams(max_new_tokens=32))  # warm-up
        llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompts[:32]],
            VSamplingParams(max_tokens=32, detokenize=False),
            use_tqdm=False,
        )
        for r in range(args.reps):
            batch = fresh_batch(prompts, r)  # the same prompts for both sides
            for side in ("engine", "raw") if r % 2 == 0 else ("raw", "engine"):
                t, cpu = time.perf_counter(), time.process_time()
                if side == "engine":
                    ntok = engine_tokens(engine, batch, sp)
                    label = "VLLMEngine"
                else:
                    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], vsp, use_tqdm=False)
                    ntok = sum(len(o.outputs[0].token_ids) for o in outs)
                    label = "vllm.LLM"
                record(results, label, r, ntok, time.perf_counter() - t, time.process_time() - cpu)
    finally:
        engine.shutdown()

    report(
        args,
        results,
        "path",
        {"VLLMEngine.generate": "VLLMEngine", "vllm.LLM.generate": "vllm.LLM"},
        ("VLLMEngine", "vllm.LLM"),
        "ratio",
        "ratio VLLMEngine / raw",
        " (target >= 0.95)",
    )


if __name__ == "__main__":
    main()
