"""FP8 on the GPU machine: vLLM online FP8 rollout (sync re-quantizes; canary within the FP8
bounds; stale weights still fail it) and a trainer step with torchao float8 linears.

    PYTHONPATH=$PWD:$PYTHONPATH python -m pytest -m gpu tests/gpu/test_fp8_gpu.py -v -s

Needs nvidia-h200-x2 for the rollout test (trainer-like process on GPU 0, engine on GPU 1) and
torchao (the ``fp8`` extra) for the trainer tests.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUCKET = 256 * 1024 * 1024
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm")
needs_torchao = pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="needs torchao (fp8 extra)")


@pytest.fixture(scope="module")
def fp8_engine():
    from benchmarks.harness import trainer_and_engine

    with trainer_and_engine("qwen3-0.6b", BUCKET, quantization="fp8") as state:
        yield state


def _sync(s, send=True):
    from benchmarks.harness import step_and_sync

    s["step"] += 1
    if send:
        s["version"] += 1
    return step_and_sync(s["engine"], s["trainer"], s["info"], s["version"], seed=s["step"], send=send)


@pytest.mark.gpu(gpus=2)
@needs_vllm
def test_fp8_rollout_sync_requantizes_and_passes_the_fp8_canary(fp8_engine):
    import torch

    from benchmarks.harness import canary
    from rlcore.weights.canary import FP8_MAX_GAP, FP8_MEAN_GAP

    s, limits = fp8_engine, dict(max_gap=FP8_MAX_GAP, mean_gap=FP8_MEAN_GAP)
    engine = s["engine"]
    names = ["model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.self_attn.qkv_proj.weight_scale"]
    times = _sync(s)
    w1, scale1 = (engine.state_dict(names)[n] for n in names)
    assert w1.dtype == torch.float8_e4m3fn, w1.dtype  # served in FP8
    ok = canary(engine, s["trainer"], s["pairs"], **limits)
    print(f"\nfp8 sync {times['e2e_s'] * 1e3:.1f} ms ({times}); after sync {ok.describe()}")
    assert ok.passed, ok.describe()
    _sync(s)
    w2, scale2 = (engine.state_dict(names)[n] for n in names)
    assert w2.dtype == torch.float8_e4m3fn and not torch.equal(w1.view(torch.uint8), w2.view(torch.uint8))
    assert not torch.equal(scale1, scale2)  # re-quantized from the new bf16 weights, not copied
    assert canary(engine, s["trainer"], s["pairs"], **limits).passed
    _sync(s, send=False)  # trainer steps, engine keeps the old weights
    stale = canary(engine, s["trainer"], s["pairs"], **limits)
    print(f"fp8 stale: {stale.describe()}")
    assert not stale.passed
    _sync(s)
    assert canary(engine, s["trainer"], s["pairs"], **limits).passed


@pytest.mark.gpu(gpus=2)
@needs_vllm
def test_fp8_rollout_refuses_direct_reload(fp8_engine):
    engine = fp8_engine["engine"]
    engine.reload = "direct"
    try:
        with pytest.raises(ValueError, match="layerwise"):
            engine.receive_weights(fp8_engine["info"], 99)
    finally:
        engine.reload = "layerwise"
    assert engine._broken is None  # refused before anything was received


_TRAIN_STEP = r"""
import json, torch
from transformers import AutoConfig, AutoModelForCausalLM
from rlcore.trainer.float8 import apply_float8
torch.manual_seed(0)
cfg = AutoConfig.for_model("qwen3", hidden_size=1024, intermediate_size=3072, num_hidden_layers=4,
                           num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=32768)
ref = AutoModelForCausalLM.from_config(cfg).cuda().to(torch.bfloat16)
ids = torch.randint(0, 32768, (2, 512), device="cuda")
out = {}
for recipe in ("tensorwise", "rowwise"):
    model = AutoModelForCausalLM.from_config(cfg).cuda().to(torch.bfloat16)
    model.load_state_dict(ref.state_dict())
    names = apply_float8(model, recipe)
    lp = torch.log_softmax(model(ids).logits.float(), -1)
    with torch.no_grad():
        lp_ref = torch.log_softmax(ref(ids).logits.float(), -1)
    tok = ids[:, 1:, None]
    a, b = lp[:, :-1].gather(-1, tok)[..., 0], lp_ref[:, :-1].gather(-1, tok)[..., 0]
    (-a.mean()).backward()
    torch.optim.AdamW(model.parameters(), lr=1e-5).step()
    grads = [p.grad for n, p in model.named_parameters() if "q_proj" in n]
    out[recipe] = dict(converted=len(names), max_gap=float((a - b).abs().max()), mean_gap=float((a - b).abs().mean()),
                       k3=float((torch.expm1(b.detach() - a.detach()) - (b - a).detach()).mean()),
                       grads_finite=all(bool(torch.isfinite(g).all()) for g in grads))
print("RESULT " + json.dumps(out))
"""


@pytest.mark.gpu(gpus=1)
@needs_torchao
def test_fp8_train_step_matches_bf16_within_fp8_noise():
    import json

    from rlcore.weights.canary import FP8_MAX_GAP, FP8_MEAN_GAP

    proc = subprocess.run(
        [sys.executable, "-c", _TRAIN_STEP],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={
            **os.environ,
            "CUDA_VISIBLE_DEVICES": "0",
            "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
        },
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.split("RESULT ", 1)[1])
    print(f"\n{res}")
    for recipe, r in res.items():
        assert r["converted"] == 4 * 7 and r["grads_finite"], (recipe, r)
        assert r["max_gap"] < FP8_MAX_GAP and r["mean_gap"] < FP8_MEAN_GAP, (recipe, r)


@pytest.mark.gpu(gpus=1)
@needs_torchao
def test_fp8_trainer_benchmark_step_runs():
    proc = subprocess.run(
        [
            sys.executable,
            "benchmarks/trainer_mfu.py",
            "--tokens",
            "2048",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--fp8",
            "tensorwise",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": "0"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    print(proc.stdout)
    assert "fp8=tensorwise" in proc.stdout and "loss=nan" not in proc.stdout
