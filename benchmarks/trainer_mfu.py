"""Trainer throughput (tokens/s) and MFU of rlcore's training step on random-weight Qwen3 shapes.

The timed step is the trainer's own path: `rlcore.trainer.parallel.parallelize` (FSDP2, EP, CP,
activation checkpointing, chunked logprob head), `rlcore.trainer.forward.forward_logprobs` on one
packed micro-batch per rank (samples with position ids reset, variable-length attention), a
token-level policy-gradient-like loss, backward, global grad-norm clip and AdamW. Weights are fp32
with bf16 compute (the trainer's mixed precision) on GPU.

    python benchmarks/trainer_mfu.py --tokens 8192                                 # 1 GPU, 0.6B
    torchrun --nproc_per_node 2 benchmarks/trainer_mfu.py --shape qwen3-moe-small --ep 2
    torchrun --nproc_per_node 2 benchmarks/trainer_mfu.py --tokens 32768 --sample-len 32768 --cp 2
    python benchmarks/trainer_mfu.py --tiny                                        # CPU smoke check
    python benchmarks/trainer_mfu.py --shape qwen3-4b --tokens 4096 --fp8 tensorwise   # FP8 matmuls (H100/H200)

FLOPs (model FLOPs: recomputation from activation checkpointing is not counted)::

    dense  = 6 * N * tokens,   N = matmul parameters a token passes through: every parameter but
             the input embedding (the lm_head counts even when tied), MoE experts counted top-k/E
    attn   = 6 * layers * heads * head_dim * sum_i s_i^2       (causal QK^T and PV, fwd + bwd,
             over the packed samples of length s_i: 2 matmuls x 2 FLOP x s^2/2, x3 for training)
    MFU    = (dense [+ attn]) / (step time * GPUs * peak);  peak = 989 TFLOP/s (H200 bf16 dense)

Both MFU figures are printed: ``mfu`` (6N only, the usual headline) and ``mfu_attn`` (with attn).
With ``--fp8`` (torchao float8 linears, `rlcore.trainer.float8`) MFU is still against the bf16
dense peak (989 TFLOP/s), so FP8 and bf16 runs compare directly (FP8's own peak is 2x that).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

PEAK_TFLOPS = {"h200": 989.0, "h100": 989.0, "a100": 312.0}

# Qwen3 shapes (public configs); qwen3-moe-small is Qwen3-30B-A3B's layer shape at half width
SHAPES = {
    "qwen3-0.6b": dict(model_type="qwen3", hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                       tie_word_embeddings=True),
    "qwen3-moe-small": dict(model_type="qwen3_moe", hidden_size=1024, intermediate_size=3072, num_hidden_layers=12,
                            num_attention_heads=16, num_key_value_heads=4, head_dim=128, vocab_size=151936,
                            num_experts=64, num_experts_per_tok=8, moe_intermediate_size=384, norm_topk_prob=True,
                            decoder_sparse_step=1, tie_word_embeddings=False),
    "qwen3-4b": dict(model_type="qwen3", hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                     tie_word_embeddings=True),
    "tiny": dict(model_type="qwen3", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512, tie_word_embeddings=True),
    "tiny-moe": dict(model_type="qwen3_moe", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512, num_experts=4,
                     num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True, decoder_sparse_step=1,
                     tie_word_embeddings=False),
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="qwen3-0.6b", choices=sorted(SHAPES))
    p.add_argument("--tiny", action="store_true", help="tiny shape (tiny-moe for MoE shapes), small defaults: CPU smoke")
    p.add_argument("--tokens", type=int, default=None, help="packed tokens per micro-batch per data-parallel rank (8192)")
    p.add_argument("--sample-len", type=int, default=None,
                   help="mean sample length in the packed row (lengths uniform in [len/2, 3len/2]); default tokens/8")
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--cp", type=int, default=1)
    p.add_argument("--ac", default="none", choices=["none", "full", "selective"], help="activation checkpointing")
    p.add_argument("--chunk", type=int, default=2048, help="logprob chunk tokens (0 = full [T, V] logits)")
    p.add_argument("--attn", default=None, choices=["varlen", "hf"],
                   help="varlen: rlcore's varlen kernel (default on CUDA); hf: transformers sdpa + block mask")
    p.add_argument("--steps", type=int, default=None, help="timed steps (10)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (3)")
    p.add_argument("--gpu", default="h200", choices=sorted(PEAK_TFLOPS), help="peak FLOP/s to divide by")
    p.add_argument("--no-mixed-precision", action="store_true", help="fp32 compute on GPU")
    p.add_argument("--out", default=None, help="write the result as JSON here (rank 0)")
    p.add_argument("--fp8", default="none", choices=["none", "tensorwise", "rowwise"],
                   help="trainer.fp8: FP8 matmuls in the decoder linears (torchao; emulated on CPU)")
    a = p.parse_args(argv)
    if a.tiny:
        a.shape = "tiny-moe" if SHAPES[a.shape].get("num_experts") else "tiny"
    small = a.shape.startswith("tiny")
    a.tokens = a.tokens or (512 if small else 8192)
    a.steps = a.steps if a.steps is not None else (2 if small else 10)
    a.warmup = a.warmup if a.warmup is not None else (1 if small else 3)
    a.sample_len = a.sample_len or max(a.tokens // 8, 1)
    return a


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
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    return rank, world, torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")


def build(shape: dict, seed: int = 0) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM
    arch = dict(shape)
    cfg = AutoConfig.for_model(arch.pop("model_type"), max_position_embeddings=65536, **arch)
    cfg._attn_implementation = "sdpa"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)  # identical initial weights on every rank (FSDP2 shards them)
        return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)


def packed_batch(tokens: int, sample_len: int, vocab: int, seed: int):
    """One packed micro-batch of random samples totalling exactly ``tokens`` tokens."""
    from rlcore.packing import make_micro_batch
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
        samples.append(Sample(prompt_ids=ids[:n - c], completion_ids=ids[n - c:], logprobs=[-1.0] * c,
                              versions=[0] * c, loss_mask=[1] * c))
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
            numel = numel * shape["num_experts_per_tok"] / shape["num_experts"]
        n += numel
    return 6.0 * n


def main(argv=None) -> dict:
    a = parse_args(argv)
    rank, world, device = init_distributed()
    from rlcore.config import TrainerConfig
    from rlcore.trainer.forward import forward_logprobs
    from rlcore.trainer.parallel import Meshes, ParallelDims, clip_grad_norm, parallelize

    shape = SHAPES[a.shape]
    t = TrainerConfig(world_size=world, cp=a.cp, ep=a.ep, activation_checkpointing=a.ac,
                      logprob_chunk_tokens=a.chunk, mixed_precision=not a.no_mixed_precision, fp8=a.fp8)
    dims = ParallelDims.from_config(t, world)
    meshes = Meshes.build(dims, device.type)
    model = build(shape)
    dense_per_token = flops_per_token_dense(model, shape)  # before sharding: full parameter counts
    n_params = sum(p.numel() for p in model.parameters())
    attn = a.attn or ("varlen" if device.type == "cuda" else "hf")
    attn = "varlen" if dims.cp > 1 else attn  # Ulysses CP runs inside rlcore's varlen attention
    model = parallelize(model.to(device), t, meshes, device, attention="varlen" if attn == "varlen" else None)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-6, fused=device.type == "cuda")

    # each data-parallel group gets its own micro-batch; cp ranks of a group share it
    mb, lengths = packed_batch(a.tokens, a.sample_len, shape["vocab_size"], seed=dims.data_rank(rank))
    attn_per_layer = 6.0 * shape["num_attention_heads"] * shape["head_dim"] * sum(n * n for n in lengths)
    step_dense = dense_per_token * a.tokens * dims.dp  # every dp group holds the same token count
    step_attn = attn_per_layer * shape["num_hidden_layers"] * dims.dp
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def step() -> float:
        lp, ent = forward_logprobs(model, mb, 1.0, meshes, device)
        mask = mb.loss_mask.to(device)
        # token-level policy-gradient shape: sum(A * logp * m) / N with an entropy term
        loss = -((lp * mb.advantages.to(device) + 1e-3 * ent) * mask).sum() / mask.sum().clamp_min(1)
        (loss * world).backward()
        clip_grad_norm(model, 1.0, meshes)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    for _ in range(a.warmup):
        step()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    sync()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(a.steps):
        loss = step()
    sync()
    dist.barrier()
    dt = (time.perf_counter() - start) / max(a.steps, 1)

    peak = PEAK_TFLOPS[a.gpu] * 1e12
    result = {
        "shape": a.shape, "params": n_params, "world": world, "dp": dims.dp, "cp": dims.cp, "ep": dims.ep,
        "tokens_per_micro_batch": a.tokens, "samples_per_micro_batch": len(lengths), "mean_sample_len": a.sample_len,
        "activation_checkpointing": a.ac, "logprob_chunk_tokens": a.chunk, "attention": attn, "fp8": a.fp8,
        "step_s": dt, "tokens_per_s": a.tokens * dims.dp / dt, "tokens_per_s_per_gpu": a.tokens * dims.dp / dt / world,
        "tflops_per_gpu": (step_dense + step_attn) / dt / world / 1e12,
        "mfu": step_dense / (dt * world * peak), "mfu_attn": (step_dense + step_attn) / (dt * world * peak),
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "loss": loss,
    }
    if rank == 0:
        print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in result.items()), flush=True)
        if a.out:
            with open(a.out, "w") as f:
                json.dump(result, f, indent=2)
    dist.destroy_process_group()
    return result


if __name__ == "__main__":
    main()
