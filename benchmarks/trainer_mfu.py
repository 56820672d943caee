"""Trainer throughput (tokens/s) and MFU of rlcore's training step on random-weight Qwen3 shapes.

The timed step is the trainer's own path: `rlcore.trainer.parallel.parallelize` (FSDP2, EP, CP,
activation checkpointing, chunked logprob head, ``trainer.compile``, ``trainer.param_dtype``),
then per optimizer step ``K`` packed micro-batches per rank (samples with position ids reset,
variable-length attention; distinct packings, so shapes change between micro-batches as in a real
step), each `rlcore.trainer.forward.forward_logprobs` + a token-level policy-gradient-like loss +
backward (gradient sync on the last micro-batch only, as `TrainerCore`), then the global
grad-norm clip and fused AdamW. Default weights: fp32 with bf16 compute on GPU.

One call measures a matrix: ``--variants`` (comma-separated; each a ``+``-joined set of switches,
see `VARIANT_SWITCHES`) x ``--micro-batches`` (comma-separated K). Every variant builds a fresh
model, warms up (compiles), then times each K on the same model. ``--profile`` adds one profiled
step per variant (smallest K): top CUDA kernels, kernel classes, GPU idle gaps, top CPU ops.

    python benchmarks/trainer_mfu.py --variants eager,compile,compile+bf16params --micro-batches 1,4 --profile
    torchrun --nproc_per_node 2 benchmarks/trainer_mfu.py --shape qwen3-moe-small --ep 2 --variants eager,compile
    torchrun --nproc_per_node 2 benchmarks/trainer_mfu.py --tokens 32768 --sample-len 32768 --cp 2
    python benchmarks/trainer_mfu.py --tiny --variants eager,compile --compile-backend aot_eager   # CPU smoke
    python benchmarks/trainer_mfu.py --shape qwen3-4b --tokens 4096 --fp8 tensorwise   # FP8 matmuls (H100/H200)

FLOPs (model FLOPs: recomputation from activation checkpointing is not counted)::

    dense  = 6 * N * tokens,   N = matmul parameters a token passes through: every parameter but
             the input embedding (the lm_head counts even when tied), MoE experts counted top-k/E
    attn   = 6 * layers * heads * head_dim * sum_i s_i^2       (causal QK^T and PV, fwd + bwd,
             over the packed samples of length s_i: 2 matmuls x 2 FLOP x s^2/2, x3 for training)
    MFU    = (dense [+ attn]) / (step time * GPUs * peak);  peak = 989 TFLOP/s (H200 bf16 dense)

Both MFU figures are printed: ``mfu`` (6N only, the usual headline) and ``mfu_attn`` (with attn).
Every row states K: with K = 1 the optimizer step (and grad clip) is paid per micro-batch.
With ``--fp8`` (torchao float8 linears, `rlcore.trainer.float8`) MFU is still against the bf16
dense peak (989 TFLOP/s), so FP8 and bf16 runs compare directly (FP8's own peak is 2x that).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _rlcore_tree(argv: list[str]) -> str | None:
    """``--rlcore-tree PATH``: import rlcore from another checkout (an A/B of two trees with this
    one driver, e.g. ``git archive BASE --prefix=.ab/old/ | tar -x``); read before rlcore is imported."""
    for i, a in enumerate(argv):
        if a == "--rlcore-tree" and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith("--rlcore-tree="):
            return a.split("=", 1)[1]
    return None


if _rlcore_tree(sys.argv[1:]):
    sys.path.insert(0, os.path.abspath(_rlcore_tree(sys.argv[1:])))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks.harness import MODEL_SHAPES  # noqa: E402
from rlcore.trainer import logprob_kernels  # noqa: E402

KERNELS_AVAILABLE = logprob_kernels.available  # the `torchhead` switch replaces it per variant

PEAK_TFLOPS = {"h200": 989.0, "h100": 989.0, "a100": 312.0}

# Qwen3 shapes: the dense ones are the other benchmarks' (public configs); qwen3-moe-small is
# Qwen3-30B-A3B's layer shape at half width
SHAPES = {
    **{name: dict(model_type="qwen3", **shape) for name, shape in MODEL_SHAPES.items()},
    "qwen3-moe-small": dict(
        model_type="qwen3_moe",
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=12,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=128,
        vocab_size=151936,
        num_experts=64,
        num_experts_per_tok=8,
        moe_intermediate_size=384,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        tie_word_embeddings=False,
    ),
    # GLM-4.5-Air's router and layout at qwen3-moe-small's size: sigmoid scores with a correction
    # bias (n_group = topk_group = 1), routed_scaling_factor, 1 shared expert, the first layer dense
    "glm-moe-small": dict(
        model_type="glm4_moe",
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=12,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=128,
        vocab_size=151552,
        n_routed_experts=64,
        num_experts_per_tok=8,
        moe_intermediate_size=384,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=1.0,
        norm_topk_prob=True,
        first_k_dense_replace=1,
        partial_rotary_factor=0.5,
        use_qk_norm=False,
        tie_word_embeddings=False,
    ),
    "tiny": dict(
        model_type="qwen3",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=512,
        tie_word_embeddings=True,
    ),
    "tiny-moe": dict(
        model_type="qwen3_moe",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=512,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        tie_word_embeddings=False,
    ),
    "tiny-glm-moe": dict(
        model_type="glm4_moe",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=512,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        norm_topk_prob=True,
        first_k_dense_replace=1,
        use_qk_norm=False,
        tie_word_embeddings=False,
    ),
}


def routed_experts(shape: dict) -> int:
    """Routed experts of a shape by its family's key (0: dense)."""
    return int(shape.get("num_experts") or shape.get("n_routed_experts") or shape.get("num_local_experts") or 0)


# variant switch -> TrainerConfig overrides ("eager" is the baseline: no override). A new trainer
# switch (e.g. fp8) is one more line here.
VARIANT_SWITCHES: dict[str, dict] = {
    "eager": {"compile": False},
    "compile": {"compile": True},
    "bf16params": {"param_dtype": "bfloat16"},
    "fp32compute": {"mixed_precision": False},
    "noac": {"activation_checkpointing": "none"},
    "sac": {"activation_checkpointing": "selective"},
    "fullac": {"activation_checkpointing": "full"},
    "recompute": {"logprob_keep_logits_gib": 0.0},
}
# switches that are not TrainerConfig fields: hf (transformers sdpa attention instead of varlen),
# loop (MoE experts as a per-expert loop instead of torch._grouped_mm), chunk<N> (logprob chunk),
# layerunits (every decoder layer its own FSDP2 unit also at world size 1), torchhead (the
# logprob head's chunk math in torch / torch.compile instead of rlcore's Triton kernels)
EXTRA_SWITCHES = ("hf", "loop", "layerunits", "torchhead", "chunk<N>")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="qwen3-0.6b", choices=sorted(SHAPES))
    p.add_argument(
        "--tiny", action="store_true", help="tiny shape (tiny-moe for MoE shapes), small defaults: CPU smoke"
    )
    p.add_argument(
        "--tokens", type=int, default=None, help="packed tokens per micro-batch per data-parallel rank (8192)"
    )
    p.add_argument(
        "--sample-len",
        type=int,
        default=None,
        help="mean sample length in the packed row (lengths uniform in [len/2, 3len/2]); default tokens/8",
    )
    p.add_argument(
        "--micro-batches",
        default="1,4",
        help="comma-separated K: micro-batches per optimizer step (each of --tokens tokens); one row each",
    )
    p.add_argument(
        "--variants",
        default="compile",
        help="comma-separated variants, each '+'-joined switches: "
        + ", ".join(VARIANT_SWITCHES)
        + ", "
        + ", ".join(EXTRA_SWITCHES)
        + " (e.g. eager,compile,compile+bf16params)",
    )
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--cp", type=int, default=1)
    p.add_argument(
        "--ac",
        default="none",
        choices=["none", "full", "selective"],
        help="activation checkpointing unless a variant says otherwise",
    )
    p.add_argument("--chunk", type=int, default=2048, help="logprob chunk tokens (0 = full [T, V] logits)")
    p.add_argument(
        "--attn",
        default=None,
        choices=["varlen", "hf"],
        help="varlen: rlcore's varlen kernel (default on CUDA); hf: transformers sdpa + block mask",
    )
    p.add_argument("--steps", type=int, default=None, help="timed optimizer steps per K (10)")
    p.add_argument("--warmup", type=int, default=None, help="untimed optimizer steps at the largest K first (2)")
    p.add_argument("--gpu", default="h200", choices=sorted(PEAK_TFLOPS), help="peak FLOP/s to divide by")
    p.add_argument("--no-mixed-precision", action="store_true", help="fp32 compute on GPU")
    p.add_argument("--compile-backend", default="inductor", help="torch.compile backend (aot_eager: fast CPU smoke)")
    p.add_argument("--profile", action="store_true", help="one profiled step per variant (smallest K), summarised")
    p.add_argument("--trace-dir", default=None, help="with --profile: also write a chrome trace per variant here")
    p.add_argument("--profile-top", type=int, default=12, help="with --profile: how many CUDA kernels to list")
    p.add_argument("--out", default=None, help="write all rows as JSON here (rank 0)")
    p.add_argument(
        "--rlcore-tree",
        default=None,
        help="import rlcore from this checkout instead of this one (A/B of two trees, same driver)",
    )
    p.add_argument(
        "--fp8",
        default="none",
        choices=["none", "tensorwise", "rowwise"],
        help="trainer.fp8: FP8 matmuls in the decoder linears (torchao; emulated on CPU)",
    )
    a = p.parse_args(argv)
    if a.tiny:
        shape = SHAPES[a.shape]
        a.shape = (
            ("tiny-glm-moe" if shape["model_type"] == "glm4_moe" else "tiny-moe") if routed_experts(shape) else "tiny"
        )
    small = a.shape.startswith("tiny")
    a.tokens = a.tokens or (512 if small else 8192)
    a.steps = a.steps if a.steps is not None else (2 if small else 10)
    a.warmup = a.warmup if a.warmup is not None else (1 if small else 2)
    a.sample_len = a.sample_len or max(a.tokens // 8, 1)
    a.micro_batches = sorted({int(k) for k in str(a.micro_batches).split(",") if k.strip()})
    a.variants = [v.strip() for v in a.variants.split(",") if v.strip()]
    for v in a.variants:
        variant_settings(v, a)  # fail on an unknown switch before any work
    return a


def variant_settings(variant: str, a: argparse.Namespace) -> tuple[dict, dict]:
    """(TrainerConfig kwargs, benchmark-only settings) of one variant over the command-line defaults."""
    t = dict(activation_checkpointing=a.ac, logprob_chunk_tokens=a.chunk, mixed_precision=not a.no_mixed_precision)
    extra = {"attn": a.attn, "moe_loop": False, "layer_units": None, "torchhead": False}
    for sw in variant.split("+"):
        if sw in VARIANT_SWITCHES:
            t.update(VARIANT_SWITCHES[sw])
        elif sw == "hf":
            extra["attn"] = "hf"
        elif sw == "loop":
            extra["moe_loop"] = True
        elif sw == "layerunits":
            extra["layer_units"] = True
        elif sw == "torchhead":
            extra["torchhead"] = True
        elif sw.startswith("chunk") and sw[5:].isdigit():
            t["logprob_chunk_tokens"] = int(sw[5:])
        else:
            raise SystemExit(
                f"unknown variant switch {sw!r} in {variant!r}; "
                f"known: {', '.join(VARIANT_SWITCHES)}, {', '.join(EXTRA_SWITCHES)}"
            )
    return t, extra


def init_distributed() -> tuple[int, int, torch.device]:
    """torchrun's env if present, else a one-process group (so the same FSDP2 code runs)."""
    cuda = torch.cuda.is_available()
    if "WORLD_SIZE" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    return rank, world, torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")


def build(shape: dict, device: torch.device, seed: int = 0) -> torch.nn.Module:
    """Random-weight model built directly on ``device`` (fast init of multi-GB shapes), fp32."""
    from transformers import AutoConfig, AutoModelForCausalLM

    arch = dict(shape)
    cfg = AutoConfig.for_model(arch.pop("model_type"), max_position_embeddings=65536, **arch)
    cfg._attn_implementation = "sdpa"
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.device(device):
        torch.manual_seed(seed)  # identical initial weights on every rank (FSDP2 shards them)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    return model.to(device)  # a no-op unless transformers built it elsewhere


def packed_batch(tokens: int, sample_len: int, vocab: int, seed: int):
    """One packed micro-batch of random samples totalling exactly ``tokens`` tokens."""
    from rlcore.batch.packing import make_micro_batch
    from rlcore.types import Sample

    g = torch.Generator().manual_seed(seed)
    lengths, left = [], tokens
    while left > 0:
        lo, hi = max(sample_len // 2, 2), max(sample_len * 3 // 2, 3)
        n = min(int(torch.randint(lo, hi + 1, (1,), generator=g)), left)
        n = n if left - n >= 2 or left - n == 0 else left  # no 1-token tail sample
        lengths.append(n)
        left -= n
    samples = []
    for n in lengths:
        ids = torch.randint(0, vocab, (n,), generator=g).tolist()
        c = max(n // 2, 1) if n > 1 else 0
        samples.append(
            Sample(
                prompt_ids=ids[: n - c],
                completion_ids=ids[n - c :],
                logprobs=[-1.0] * c,
                versions=[0] * c,
                loss_mask=[1] * c,
            )
        )
    return make_micro_batch(samples, [1.0] * len(samples)), lengths


def flops_per_token_dense(model: torch.nn.Module, shape: dict) -> float:
    """6 N with N the matmul parameters per token (see the module docstring); call before
    sharding, while parameters have their full sizes."""
    n = 0
    embed = model.get_input_embeddings().weight
    for name, p in model.named_parameters():
        if p is embed and not shape.get("tie_word_embeddings"):
            continue
        numel = p.numel()
        if ".experts." in name:
            numel = numel * shape["num_experts_per_tok"] / routed_experts(shape)
        n += numel
    return 6.0 * n


# -- profile summary ----------------------------------------------------------------------------

KERNEL_CLASSES = (  # first match wins; names are lower-cased
    ("nccl", ("nccl",)),
    ("attention", ("flash", "fmha", "attention", "attn")),
    ("gemm", ("gemm", "cutlass", "nvjet", "cublas", "sm90_xmma", "sm80_xmma", "grouped_mm", "matmul", "wgmma")),
    ("triton", ("triton",)),
    ("copy/cast", ("copy", "memcpy", "memset", "cast", "fill", "cat")),
    ("optimizer", ("adam", "foreach", "multi_tensor")),
)


def kernel_class(name: str) -> str:
    low = name.lower()
    for cls, keys in KERNEL_CLASSES:
        if any(k in low for k in keys):
            return cls
    return "other (eager elementwise/reduce)"


def summarize_profile(events, wall_us: float, top: int = 12, gap_us: float = 20.0) -> dict:
    """Digest of one profiled step from ``prof.events()`` (FunctionEvents, times in us).

    GPU busy = union of kernel intervals; idle gaps = holes between them (the GPU waiting on the
    host: launches, syncs, Python); ``top_kernels`` by total time; ``top_cpu_ops`` by self CPU
    time (where the host spends its time)."""
    from torch.autograd import DeviceType

    kernels, cpu = [], {}
    for e in events:
        dt = getattr(e, "device_type", None)
        if dt == DeviceType.CUDA:
            kernels.append((e.time_range.start, e.time_range.end, e.name))
        elif dt == DeviceType.CPU:
            rec = cpu.setdefault(e.name, [0, 0.0])
            rec[0] += 1
            rec[1] += getattr(e, "self_cpu_time_total", 0.0) or 0.0
    by_name, by_class = {}, {}
    for s, t, name in kernels:
        rec = by_name.setdefault(name, [0, 0.0])
        rec[0] += 1
        rec[1] += t - s
        by_class[kernel_class(name)] = by_class.get(kernel_class(name), 0.0) + (t - s)
    busy, gaps = 0.0, []
    if kernels:
        kernels.sort()
        cur_s, cur_e = kernels[0][0], kernels[0][1]
        for s, t, name in kernels[1:]:
            if s > cur_e:
                busy += cur_e - cur_s
                if s - cur_e >= gap_us:
                    gaps.append((s - cur_e, name))
                cur_s, cur_e = s, t
            else:
                cur_e = max(cur_e, t)
        busy += cur_e - cur_s
    gaps.sort(reverse=True)
    total_k = sum(v[1] for v in by_name.values()) or 1.0
    return {
        "wall_ms": wall_us / 1e3,
        "gpu_busy_ms": busy / 1e3,
        "gpu_busy_frac": busy / wall_us if wall_us else 0.0,
        "kernels": len(kernels),
        "gaps_over_us": gap_us,
        "gap_count": len(gaps),
        "gap_total_ms": sum(g for g, _ in gaps) / 1e3,
        "largest_gaps": [{"us": round(g, 1), "before_kernel": n[:80]} for g, n in gaps[:5]],
        "kernel_classes_ms": {k: round(v / 1e3, 3) for k, v in sorted(by_class.items(), key=lambda kv: -kv[1])},
        "top_kernels": [
            {"name": n[:100], "calls": c, "ms": round(t / 1e3, 3), "frac": round(t / total_k, 4)}
            for n, (c, t) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]
        ],
        "top_cpu_ops": [
            {"name": n[:80], "calls": c, "self_ms": round(t / 1e3, 3)}
            for n, (c, t) in sorted(cpu.items(), key=lambda kv: -kv[1][1])[:24]
        ],
        # host waits on the device: each one drains the launch queue
        "host_syncs": {
            n: {"calls": c, "self_ms": round(t / 1e3, 3)}
            for n, (c, t) in cpu.items()
            if "Synchronize" in n or n.startswith("cudaMemcpy") or n == "aten::_local_scalar_dense"
        },
    }


def format_profile(variant: str, k: int, s: dict) -> str:
    lines = [
        f"-- profile: {variant}, K={k}: wall {s['wall_ms']:.1f} ms, GPU busy {s['gpu_busy_ms']:.1f} ms "
        f"({100 * s['gpu_busy_frac']:.0f}%), {s['kernels']} kernels, {s['gap_count']} idle gaps >= "
        f"{s['gaps_over_us']:.0f} us totalling {s['gap_total_ms']:.1f} ms",
        "   kernel classes (ms): " + ", ".join(f"{k_}={v}" for k_, v in s["kernel_classes_ms"].items()),
    ]
    if s["top_kernels"]:
        lines.append(f"   {'ms':>8} {'%':>5} {'calls':>6}  top CUDA kernels")
        lines += [
            f"   {r['ms']:8.2f} {100 * r['frac']:5.1f} {r['calls']:6d}  {r['name'][:90]}" for r in s["top_kernels"]
        ]
    if s["largest_gaps"]:
        lines.append(
            "   largest GPU idle gaps (us, kernel after the gap): "
            + "; ".join(f"{g['us']:.0f} {g['before_kernel'][:40]}" for g in s["largest_gaps"])
        )
    lines.append(f"   {'self ms':>8} {'calls':>6}  top CPU ops (self time)")
    lines += [f"   {r['self_ms']:8.2f} {r['calls']:6d}  {r['name']}" for r in s["top_cpu_ops"]]
    if s["host_syncs"]:
        lines.append(
            "   host syncs: " + "; ".join(f"{n} x{v['calls']} {v['self_ms']} ms" for n, v in s["host_syncs"].items())
        )
    return "\n".join(lines)


# -- one variant ----------------------------------------------------------------------------------


def run_variant(a: argparse.Namespace, variant: str, rank: int, world: int, device: torch.device) -> list[dict]:
    from rlcore.batch.parallel_dims import ParallelDims
    from rlcore.config import TrainerConfig
    from rlcore.trainer.forward import forward_logprobs
    from rlcore.trainer.moe import expert_modules
    from rlcore.trainer.parallel import Meshes, begin_micro_batch, clip_grad_norm, parallelize

    shape = SHAPES[a.shape]
    t_kwargs, extra = variant_settings(variant, a)
    logprob_kernels.available = (lambda z: False) if extra["torchhead"] else KERNELS_AVAILABLE
    t_kwargs = {**t_kwargs, "fp8": a.fp8}
    t = TrainerConfig(world_size=world, cp=a.cp, ep=a.ep, **t_kwargs)
    dims = ParallelDims.from_config(t, world)
    meshes = Meshes.build(dims, device.type)
    t0 = time.perf_counter()
    model = build(shape, device)
    dense_per_token = flops_per_token_dense(model, shape)  # before sharding: full parameter counts
    n_params = sum(p.numel() for p in model.parameters())
    attn = extra["attn"] or ("varlen" if device.type == "cuda" else "hf")
    attn = "varlen" if dims.cp > 1 else attn  # Ulysses CP runs inside rlcore's varlen attention
    model = parallelize(
        model, t, meshes, device, attention="varlen" if attn == "varlen" else "hf", layer_units=extra["layer_units"]
    )
    if extra["moe_loop"]:
        for ex in expert_modules(model).values():
            ex.grouped = False
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-6, fused=device.type == "cuda")

    # distinct packings (sample counts and lengths differ, token count equal): each data-parallel
    # group gets its own; the cp ranks of a group share them
    k_max = max(a.micro_batches)
    pool = [
        packed_batch(a.tokens, a.sample_len, shape["vocab_size"], seed=1000 * dims.data_rank(rank) + i)
        for i in range(max(k_max, 4))
    ]
    attn_per_layer = 6.0 * shape["num_attention_heads"] * shape["head_dim"]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    cursor = [0]

    def step(k: int) -> tuple[float, float]:
        """One optimizer step over k micro-batches; returns (loss, attention FLOPs of this rank's group)."""
        loss_sum, attn_flops = torch.zeros((), device=device), 0.0
        for i in range(k):
            mb, lengths = pool[cursor[0] % len(pool)]
            cursor[0] += 1
            attn_flops += attn_per_layer * shape["num_hidden_layers"] * sum(n * n for n in lengths)
            begin_micro_batch(model, meshes, last=i == k - 1)
            lp, ent = forward_logprobs(model, mb, 1.0, meshes, device)
            mask = mb.loss_mask.to(device, non_blocking=True)
            adv = mb.advantages.to(device, non_blocking=True)
            # token-level policy-gradient shape: sum(A * logp * m) / N with an entropy term
            loss = -((lp * adv + 1e-3 * ent) * mask).sum() / (k * mask.sum().clamp_min(1))
            (loss * world).backward()
            loss_sum += loss.detach()
        clip_grad_norm(model, 1.0, meshes)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss_sum), attn_flops

    # warmup also runs every packing of the pool once: no first-shape compile in a timed step
    for _ in range(max(a.warmup, -(-len(pool) // k_max))):
        step(k_max)
    sync()
    dist.barrier()
    warmup_s = time.perf_counter() - t0  # build + parallelize + compile + warmup steps

    rows = []
    peak = PEAK_TFLOPS[a.gpu] * 1e12
    for k in a.micro_batches:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        sync()
        dist.barrier()
        start = time.perf_counter()
        attn_flops = 0.0
        for _ in range(a.steps):
            loss, af = step(k)
            attn_flops += af
        sync()
        dist.barrier()
        dt = (time.perf_counter() - start) / max(a.steps, 1)
        step_dense = dense_per_token * a.tokens * k * dims.dp  # every dp group holds the same token count
        step_attn = attn_flops / max(a.steps, 1) * dims.dp  # (rank 0's group's packings, x dp)
        tokens = a.tokens * k * dims.dp
        rows.append(
            {
                "variant": variant,
                "micro_batches": k,
                "shape": a.shape,
                "rlcore_tree": a.rlcore_tree or ".",
                "params": n_params,
                "world": world,
                "dp": dims.dp,
                "cp": dims.cp,
                "ep": dims.ep,
                "tokens_per_micro_batch": a.tokens,
                "mean_sample_len": a.sample_len,
                "trainer": t_kwargs,
                "attention": attn,
                "fp8": a.fp8,
                "step_s": dt,
                "micro_batch_s": dt / k,
                "tokens_per_s": tokens / dt,
                "tokens_per_s_per_gpu": tokens / dt / world,
                "tflops_per_gpu": (step_dense + step_attn) / dt / world / 1e12,
                "mfu": step_dense / (dt * world * peak),
                "mfu_attn": (step_dense + step_attn) / (dt * world * peak),
                "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
                "setup_and_warmup_s": warmup_s,
                "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                "loss": loss,
            }
        )

    if a.profile:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        sync()
        dist.barrier()
        k_prof = min(a.micro_batches)  # fewest events to digest; shows the optimizer's share
        with profile(activities=acts, record_shapes=bool(a.trace_dir)) as prof:
            start = time.perf_counter()
            step(k_prof)
            sync()
            wall_us = (time.perf_counter() - start) * 1e6
        summary = summarize_profile(prof.events(), wall_us, top=a.profile_top)
        rows[0]["profile"] = summary
        if rank == 0:
            print(format_profile(variant, k_prof, summary), flush=True)
            if a.trace_dir:
                os.makedirs(a.trace_dir, exist_ok=True)
                prof.export_chrome_trace(os.path.join(a.trace_dir, f"trace_{variant.replace('+', '_')}.json"))

    return rows


def format_table(rows: list[dict]) -> str:
    head = (
        f"{'variant':<28} {'K':>2} {'step_s':>7} {'mb_s':>6} {'tok/s/gpu':>10} {'TFLOP/s':>8} "
        f"{'mfu':>6} {'mfu_attn':>8} {'mem_GiB':>8} {'setup_s':>7}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['variant']:<28} {'':>2} FAILED: {r['error'][:100]}")
            continue
        mem = f"{r['peak_mem_gib']:.1f}" if r["peak_mem_gib"] is not None else "-"
        lines.append(
            f"{r['variant']:<28} {r['micro_batches']:>2} {r['step_s']:7.3f} {r['micro_batch_s']:6.3f} "
            f"{r['tokens_per_s_per_gpu']:10,.0f} {r['tflops_per_gpu']:8.1f} {r['mfu']:6.3f} "
            f"{r['mfu_attn']:8.3f} {mem:>8} {r['setup_and_warmup_s']:7.1f}"
        )
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    a = parse_args(argv)
    rank, world, device = init_distributed()
    from rlcore.trainer import compile as rl_compile

    rl_compile.BACKEND = a.compile_backend
    if rank == 0:
        print(
            f"trainer_mfu: shape={a.shape} tokens/micro-batch={a.tokens} sample_len~{a.sample_len} world={world} "
            f"cp={a.cp} ep={a.ep} K={a.micro_batches} steps={a.steps} warmup={a.warmup} variants={a.variants} "
            f"torch={torch.__version__} rlcore={os.path.dirname(os.path.dirname(rl_compile.__file__))}",
            flush=True,
        )
    rows: list[dict] = []
    for variant in a.variants:
        try:
            got = run_variant(a, variant, rank, world, device)
        except Exception as exc:  # one broken variant must not hide the others' numbers
            if world > 1:
                raise  # the other ranks may be stuck in a collective: fail loudly
            traceback.print_exc()
            got = [{"variant": variant, "error": f"{type(exc).__name__}: {exc}"}]
        rows += got
        if rank == 0:
            for r in got:
                print(
                    " ".join(
                        f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items() if k != "profile"
                    ),
                    flush=True,
                )
            if a.out:  # after every variant: a later failure or timeout keeps the earlier rows
                with open(a.out, "w") as f:
                    json.dump(rows, f, indent=2)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        torch._dynamo.reset()  # each variant compiles on its own (inductor's disk cache still helps)
    if rank == 0:
        print("\n" + format_table(rows), flush=True)
    dist.destroy_process_group()
    return rows


if __name__ == "__main__":
    main()
