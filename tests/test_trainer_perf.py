"""The trainer's speed switches on CPU: each one gives the same numbers as the plain path.

- ``trainer.compile``: per-layer torch.compile + compiled logprob chunk math (dynamo + AOT
  autograd through the ``aot_eager`` backend: inductor's code generation takes minutes on these
  CPUs; the GPU benchmark runs inductor), no graph breaks in a dense layer, one compiled graph per
  code object across micro-batches of different shapes, unchanged parameter names; through
  `TrainerCore` too.
- ``trainer.param_dtype``: bf16 parameters, float32 buffers.
- the one-all-reduce gradient clip (world 1 here; world 2 with ep in test_trainer_scale).
- MoE experts: ``torch._grouped_mm`` vs the per-expert loop, and the routing bookkeeping.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from test_trainer_scale import _free_port, loss_of, random_batch, reference_logprobs, tiny_model

from rlcore.config import TrainerConfig
from rlcore.trainer.forward import forward_logprobs

CPU = torch.device("cpu")
# total token counts avoid the model's hidden size (64): dynamo would unify equal sizes
SHAPES = ([20, 13, 30], [25, 18, 9, 17], [30, 11, 7, 9, 14])


@pytest.fixture
def aot_eager(monkeypatch):
    from rlcore.trainer import compile as rc

    monkeypatch.setattr(rc, "BACKEND", "aot_eager")
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def world1(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def _prepare(model, compiled: bool, chunk: int = 16):
    from rlcore.trainer.attention import use_varlen_attention
    from rlcore.trainer.compile import compile_layers
    from rlcore.trainer.logprobs import install_logprob_head

    head = install_logprob_head(model, chunk)
    use_varlen_attention(model, None)
    if compiled:
        compile_layers(model)
        head.compiled = True
    return model


def _run(model, temperature=0.8):
    lps, ents = [], []
    for i, lengths in enumerate(SHAPES):
        mb = random_batch(i, lengths)
        lp, ent = forward_logprobs(model, mb, temperature, None, CPU)
        loss_of(lp, ent, mb, i).backward()
        lps.append(lp.detach())
        ents.append(ent.detach())
    return lps, ents, {n: p.grad.clone() for n, p in model.named_parameters()}


def test_compile_same_logprobs_and_grads(aot_eager):
    from torch._dynamo.utils import counters

    base = tiny_model()
    eager = _run(_prepare(copy.deepcopy(base), False))
    counters.clear()
    model = _prepare(copy.deepcopy(base), True)
    got = _run(model)
    for a, b in zip(got[0] + got[1], eager[0] + eager[1]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert set(got[2]) == set(eager[2])  # names unchanged: no _orig_mod
    for n, g in eager[2].items():
        torch.testing.assert_close(got[2][n], g, atol=1e-6, rtol=1e-5, msg=n)
    # dense decoder layer and head math: no graph break; one graph each (all layers share the
    # layer graph; token count, sample count and longest sample are dynamic from the start)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 3, dict(counters["stats"])


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_compile_with_activation_checkpointing(aot_eager, mode):
    from rlcore.trainer.activation_checkpoint import apply_activation_checkpointing

    base = tiny_model()
    eager = _run(_prepare(copy.deepcopy(base), False))
    model = copy.deepcopy(base)
    apply_activation_checkpointing(model, mode)  # parallelize's order: checkpoint, then compile
    got = _run(_prepare(model, True))
    for n, g in eager[2].items():
        torch.testing.assert_close(got[2][n], g, atol=1e-6, rtol=1e-5, msg=n)


def test_compiled_chunk_math_equals_eager(aot_eager):
    from rlcore.trainer.logprobs import chunked_logprobs

    torch.manual_seed(0)
    T, H, V = 45, 16, 50
    h = torch.randn(T, H, requires_grad=True)
    W = torch.randn(V, H, requires_grad=True)
    y = torch.randint(0, V, (T,))
    a, c = torch.randn(T), torch.randn(T)
    out = {}
    for compiled in (False, True):
        h.grad = W.grad = None
        lp, ent = chunked_logprobs(h, W, y, 0.7, chunk_tokens=8, compiled=compiled)
        (lp * a + ent * c).sum().backward()
        out[compiled] = (lp.detach(), ent.detach(), h.grad.clone(), W.grad.clone())
    for x, r in zip(out[True], out[False]):
        torch.testing.assert_close(x, r, atol=1e-5, rtol=1e-5)


def test_parallelize_compile_and_bf16_params(aot_eager, world1):
    """Through parallelize (FSDP2, world 1): compiled = eager; bf16 params keep fp32 buffers."""
    from rlcore.batch.parallel_dims import ParallelDims
    from rlcore.trainer.parallel import Meshes, clip_grad_norm, parallelize

    base = tiny_model()
    mb = random_batch(3, [33, 21, 12])
    results = {}
    for name, kw in (("eager", {}), ("compile", {"compile": True}), ("bf16", {"param_dtype": "bfloat16"})):
        t = TrainerConfig(world_size=1, logprob_chunk_tokens=16, **kw)
        meshes = Meshes.build(ParallelDims.from_config(t, 1), "cpu")
        model = parallelize(copy.deepcopy(base), t, meshes, CPU, attention="varlen")
        lp, ent = forward_logprobs(model, mb, 1.0, meshes, CPU)
        loss_of(lp.float(), ent.float(), mb, 0).backward()
        results[name] = (lp.detach().float(), clip_grad_norm(model, 0.0, meshes), model)
    torch.testing.assert_close(results["compile"][0], results["eager"][0], atol=1e-5, rtol=1e-5)
    assert abs(results["compile"][1] - results["eager"][1]) < 1e-4 * results["eager"][1]
    bf16 = results["bf16"][2]
    assert all(p.dtype == torch.bfloat16 for p in bf16.parameters())
    assert bf16.model.rotary_emb.inv_freq.dtype == torch.float32
    torch.testing.assert_close(results["bf16"][0], results["eager"][0], atol=0.1, rtol=0.05)


def test_clip_grad_norm_world1(world1):
    from rlcore.batch.parallel_dims import ParallelDims
    from rlcore.trainer.parallel import Meshes, clip_grad_norm, parallelize

    base = tiny_model()
    mb = random_batch(4, [40, 27])
    ref = copy.deepcopy(base)
    lp, ent = reference_logprobs(ref, mb)
    loss_of(lp, ent, mb, 0).backward()
    ref_norm = float(torch.sqrt(sum((p.grad.double() ** 2).sum() for p in ref.parameters())))
    t = TrainerConfig(world_size=1, logprob_chunk_tokens=16)
    meshes = Meshes.build(ParallelDims.from_config(t, 1), "cpu")
    model = parallelize(copy.deepcopy(base), t, meshes, CPU)
    lp, ent = forward_logprobs(model, mb, 1.0, meshes, CPU)
    loss_of(lp, ent, mb, 0).backward()
    norm = clip_grad_norm(model, 0.0, meshes)
    assert abs(norm - ref_norm) < 1e-4 * ref_norm
    assert clip_grad_norm(model, 2 * norm, meshes) == pytest.approx(norm, rel=1e-6)  # below the cap: unchanged
    clip_grad_norm(model, norm / 4, meshes)
    assert clip_grad_norm(model, 0.0, meshes) == pytest.approx(norm / 4, rel=1e-4)


def test_trainer_core_compile(aot_eager, tiny_cfg, monkeypatch):
    """trainer.compile through TrainerCore (FSDP2, world 1): the same SFT step as eager."""
    from test_trainer_scale import sample

    from rlcore.batch.packing import make_micro_batch
    from rlcore.trainer.core import TrainerCore

    mbs = [
        make_micro_batch([sample([1, 5, 6, 7, 8, 9, 10], 4), sample([1, 11, 12, 13], 2)], [1.0, 1.0]),
        make_micro_batch([sample([1, 9, 8, 7, 6, 5, 4, 3, 2], 5)], [1.0]),
    ]
    tokens = sum(int(mb.loss_mask.sum()) for mb in mbs)
    metrics = {}
    for compiled in (False, True):
        cfg = copy.deepcopy(tiny_cfg)
        cfg.trainer.compile = compiled
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(_free_port()))
        core = TrainerCore(cfg, 0, 1)
        try:
            assert all(getattr(layer, "_rlcore_compiled", False) == compiled for layer in core.model.model.layers)
            metrics[compiled] = core.sft_step(mbs, tokens).metrics
        finally:
            core.shutdown()
    assert metrics[True]["loss"] == pytest.approx(metrics[False]["loss"], rel=1e-5)
    assert metrics[True]["grad_norm"] == pytest.approx(metrics[False]["grad_norm"], rel=1e-4)


# -- MoE experts ---------------------------------------------------------------------------------


def _moe_block(seed=0):
    from rlcore.trainer.moe import MoEBlock

    model = tiny_model("qwen3_moe", seed=seed)
    return model.model.layers[0].mlp, MoEBlock(copy.deepcopy(model.model.layers[0].mlp), None)


def test_moe_counts_and_loop_equal_transformers_block():
    hf, block = _moe_block()
    x = torch.randn(1, 37, 64)
    torch.testing.assert_close(block(x), hf(x), atol=1e-5, rtol=1e-5)
    _, _, experts = block.gate(x.reshape(-1, 64))
    counts = block.stat_counts  # recorded by the forward (grad mode): per-expert (token, slot) rows
    torch.testing.assert_close(counts, torch.bincount(experts.reshape(-1), minlength=block.num_experts).float())
    assert block.stat_tokens == 37 and float(block.stat_entropy) > 0


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch._grouped_mm missing")
def test_moe_grouped_mm_equals_loop():
    """bf16 (the grouped kernel's dtype): grouped and loop paths agree in outputs and in every
    gradient, also with an expert that receives no token (an empty group)."""
    _, base = _moe_block(seed=1)
    base = base.to(torch.bfloat16)
    # expert 3 gets nothing: every token points away from its router row
    w3 = base.gate.weight[3].detach().float()
    x0 = (torch.randn(1, 41, 64) - 20 * w3 / w3.norm()).to(torch.bfloat16)
    out = {}
    for grouped in (False, True):
        block = copy.deepcopy(base)
        block.experts.grouped = grouped
        assert block.experts.use_grouped(x0) == grouped
        x = x0.clone().requires_grad_()
        y = block(x)
        (y.float() * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
        out[grouped] = (
            y.detach().float(),
            x.grad.float(),
            {n: p.grad.float() for n, p in block.named_parameters() if p.grad is not None},
        )
        assert int(block.stat_counts[3]) == 0  # the empty group really is empty
    torch.testing.assert_close(out[True][0], out[False][0], atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out[True][1], out[False][1], atol=2e-2, rtol=2e-2)
    assert set(out[True][2]) == set(out[False][2])
    for n, g in out[False][2].items():
        torch.testing.assert_close(out[True][2][n], g, atol=5e-2, rtol=5e-2, msg=n)


def test_moe_default_is_loop_on_cpu():
    _, block = _moe_block()
    assert not block.experts.use_grouped(torch.zeros(2, 64))
    assert not block.experts.use_grouped(torch.zeros(2, 64, dtype=torch.bfloat16))  # CPU: loop


def test_compile_moe_layers_compiles_attention_norms_and_router(aot_eager):
    from rlcore.trainer.compile import compile_layers
    from rlcore.trainer.moe import apply_expert_parallel
    from rlcore.trainer.moe_kernels import kernels as moe_kernels

    base = tiny_model("qwen3_moe")
    eager = _run(_prepare(copy.deepcopy(base), False))
    model = copy.deepcopy(base)
    apply_expert_parallel(model, None)
    compile_layers(model)
    for layer in model.model.layers:
        for part in (layer.self_attn, layer.mlp.gate, layer.input_layernorm, layer.post_attention_layernorm):
            assert getattr(part, "_rlcore_compiled", False), part
        assert layer.mlp.experts.kernels is moe_kernels(compiled=True) is not moe_kernels(compiled=False)
    assert not any(
        getattr(layer, "_rlcore_compiled", False) or getattr(layer.mlp, "_rlcore_compiled", False)
        for layer in model.model.layers
    )
    got = _run(_prepare(model, False))
    for a, b in zip(got[0], eager[0]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_profile_summary_busy_and_gaps():
    """The benchmark's profile digest on synthetic kernel events (the GPU path is not run here)."""
    import importlib.util
    import types
    from pathlib import Path

    from torch.autograd import DeviceType

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "trainer_mfu.py"
    spec = importlib.util.spec_from_file_location("trainer_mfu", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)

    def ev(name, start, end, dev=DeviceType.CUDA, self_cpu=0.0):
        return types.SimpleNamespace(
            name=name,
            time_range=types.SimpleNamespace(start=start, end=end),
            device_type=dev,
            self_cpu_time_total=self_cpu,
        )

    events = [
        ev("sm90_xmma_gemm_bf16", 0, 100),
        ev("triton_red_fused_0", 50, 150),  # overlap: busy 150
        ev("flash_fwd_kernel", 400, 500),  # gap of 250 before it
        ev("ncclKernel_AllReduce", 510, 530),  # gap of 10: under the 20 us threshold
        ev("aten::mm", 0, 0, DeviceType.CPU, self_cpu=70.0),
    ]
    s = bench.summarize_profile(events, wall_us=1000.0)
    assert s["gpu_busy_ms"] == pytest.approx(0.27) and s["gpu_busy_frac"] == pytest.approx(0.27)
    assert (
        s["gap_count"] == 1 and s["largest_gaps"][0]["us"] == 250 and "flash" in s["largest_gaps"][0]["before_kernel"]
    )
    assert set(s["kernel_classes_ms"]) == {"gemm", "triton", "attention", "nccl"}
    assert s["top_kernels"][0]["name"].startswith("sm90") and s["top_cpu_ops"][0]["name"] == "aten::mm"
    assert "top CUDA kernels" in bench.format_profile("v", 1, s)


@pytest.mark.parametrize("keep_last", [False, True])
def test_parameters_kept_between_micro_batches_follow_each_update(world1, keep_last):
    """Gradient accumulation through `begin_micro_batch` (FSDP2, world 1: the unsharded
    parameters stay from one micro-batch's backward to the next forward) trains exactly like a
    plain model over two optimizer steps; the forward after each optimizer step sees the updated
    weights. (``keep_last`` breaks the contract on purpose: the last backward keeps the
    parameters too, so the next step computes with stale weights; the check must see it.)"""
    from rlcore.batch.parallel_dims import ParallelDims
    from rlcore.trainer.parallel import Meshes, begin_micro_batch, parallelize

    base = tiny_model()
    ref = copy.deepcopy(base)
    t = TrainerConfig(world_size=1, logprob_chunk_tokens=16)
    meshes = Meshes.build(ParallelDims.from_config(t, 1), "cpu")
    model = parallelize(copy.deepcopy(base), t, meshes, CPU)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, ref)]
    steps = [
        [random_batch(10, [20, 13]), random_batch(11, [25, 9])],
        [random_batch(12, [30, 7]), random_batch(13, [11, 16])],
    ]
    for micro_batches in steps:
        for i, mb in enumerate(micro_batches):
            begin_micro_batch(model, meshes, last=i == len(micro_batches) - 1 and not keep_last)
            lp, ent = forward_logprobs(model, mb, 1.0, meshes, CPU)
            loss_of(lp, ent, mb, i).backward()
            lp, ent = reference_logprobs(ref, mb)
            loss_of(lp, ent, mb, i).backward()
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
    mb = random_batch(14, [18, 21])
    with torch.no_grad():
        got, _ = forward_logprobs(model, mb, 1.0, meshes, CPU)
        want, _ = reference_logprobs(ref, mb)
    if keep_last:
        assert (got - want).abs().max() > 1e-3
    else:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
