"""FP8 switches on CPU: `trainer.fp8` / `rollout.vllm.quantization` validation (the canary bounds: tests/test_canary.py), the
FP8 module filter and torchao's float8 in emulation, and the vLLM engine's quantization plumbing
(no vLLM here: the engine's loop runs against a fake AsyncLLM). The real FP8 paths run in
tests/gpu/test_fp8_gpu.py on the GPU machine."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import types

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from rlcore.plan import validate as validate_module
from rlcore.plan.compose import compose
from rlcore.plan.validate import problems
from rlcore.run import main
from rlcore.trainer import float8

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPU = ["trainer.gpus_per_rank=1", "rollout.engine=vllm", "rollout.gpus_per_actor=1"]


@pytest.mark.parametrize(
    "overrides,key,text",
    [
        (["trainer.fp8=tensorwise"], "trainer.fp8", "need a Hopper GPU"),
        (["trainer.fp8=fp4"], "trainer.fp8", "unknown FP8 recipe"),
        (
            ["rollout.vllm.quantization=fp8"],
            "rollout.vllm.quantization",
            "an option of the vllm engine (rollout.engine=vllm)",
        ),
        ([*GPU, "rollout.vllm.quantization=int3"], "rollout.vllm.quantization", "unknown quantization"),
        (
            [*GPU, "rollout.vllm.quantization=fp8", "rollout.vllm.weight_reload=direct"],
            "rollout.vllm.weight_reload",
            "layerwise",
        ),
        (
            [*GPU, "+rollout.vllm.engine_kwargs.reload=direct"],
            "rollout.vllm.engine_kwargs.reload",
            "rollout.vllm.weight_reload",
        ),
        (
            [*GPU, "+rollout.vllm.engine_kwargs.quantization=fp8"],
            "rollout.vllm.engine_kwargs.quantization",
            "set rollout.vllm.quantization",
        ),
        (["rollout.canary_floor=0"], "rollout.canary_floor", "must be > 0"),
        (["rollout.canary_multiple=0.5"], "rollout.canary_multiple", "must be >= 1"),
        ([*GPU, "+recipe=shape_count", "trainer.fp8=tensorwise"], "trainer.fp8", "vision-language"),
    ],
)
def test_fp8_config_errors_name_the_key_before_ray(overrides, key, text, capsys, tmp_path):
    assert main([*overrides, f"output_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"rlcore: config error: {key}") and text in err[0], err


def test_fp8_switches_validate_on_gpu_configs(monkeypatch):
    assert problems(compose([*GPU, "rollout.vllm.quantization=fp8", "trainer.fp8=rowwise"])) == []
    assert problems(compose([*GPU, "trainer.fp8=tensorwise", "trainer.lora.enabled=true"]))[0][0] == "trainer.fp8"
    assert "mixed_precision" in problems(compose([*GPU, "trainer.fp8=rowwise", "trainer.mixed_precision=false"]))[0][1]
    assert problems(compose(["mode=eval", "trainer.fp8=tensorwise"])) == []  # no trainer group in eval
    monkeypatch.setattr(validate_module, "torchao_available", lambda: False)  # the name validation calls
    ((key, msg),) = problems(compose([*GPU, "trainer.fp8=tensorwise"]))
    assert key == "trainer.fp8" and "rlcore[fp8]" in msg


def _tiny(model_type="qwen3", **extra):
    arch = dict(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=False,
    )
    if model_type == "qwen3_moe":
        arch.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1)
    arch.update(extra)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **arch))


def test_fp8_filter_picks_decoder_projections_only():
    names = float8.fp8_linear_names(_tiny())
    assert names == [
        f"model.layers.{i}.{m}"
        for i in range(2)
        for m in (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
        )
    ]
    # intermediate 72 is not a multiple of 16: the MLP stays bf16, attention converts
    assert not any("mlp" in n for n in float8.fp8_linear_names(_tiny(intermediate_size=72)))
    moe = float8.fp8_linear_names(_tiny("qwen3_moe"))
    assert moe and all("self_attn" in n for n in moe)  # fused experts and the router are not nn.Linear
    lin = torch.nn.Linear(64, 64)
    for fqn in ("lm_head", "model.embed_tokens", "model.layers.0.mlp.gate", "model.layers.0.mlp.router.proj"):
        assert not float8.fp8_module_filter(lin, fqn)
    assert float8.fp8_module_filter(lin, "model.layers.0.mlp.gate_proj")


def test_fp8_emulated_training_converts_in_place_and_stays_close():
    pytest.importorskip("torchao.float8")
    ref, model = _tiny(), _tiny()
    names_before = [n for n, _ in model.named_parameters()]
    converted = float8.apply_float8(model, "tensorwise", emulate=True)
    assert len(converted) == 14 and type(model.model.layers[0].mlp.up_proj).__name__ == "Float8Linear"
    assert type(model.lm_head) is torch.nn.Linear
    assert [n for n, _ in model.named_parameters()] == names_before  # sync and checkpoints see the same names
    ids = torch.randint(0, 64, (2, 12))
    lp, lp_ref = (torch.log_softmax(m(ids).logits.float(), -1) for m in (model, ref))
    assert (lp - lp_ref).abs().max() < 0.1  # e4m3 rounding only
    lp.sum().backward()
    assert model.model.layers[0].self_attn.q_proj.weight.grad is not None
    assert float8.apply_float8(_tiny(), "none") == []


def test_fp8_missing_torchao_or_gpu_says_what_is_needed(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    with pytest.raises(ImportError, match=r"rlcore\[fp8\]"):
        float8.apply_float8(_tiny(), "tensorwise")
    monkeypatch.delitem(sys.modules, "torchao.float8")
    pytest.importorskip("torchao.float8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="compute capability >= 8.9"):
        float8.apply_float8(_tiny(), "tensorwise")  # not emulated: a real GPU is required


def test_fp8_trainer_step_through_parallelize_emulated():
    """FSDP2 (one gloo rank) + FP8 linears + chunked head + AdamW: the benchmark's own step,
    compiled (its default variant) with the aot_eager backend, the benchmark's CPU smoke and the
    backend of the suite's other CPU compile tests: torch.compile traces the FP8 linears as on a
    GPU, without inductor's CPU code generation (~25 s of the test's ~45 s)."""
    pytest.importorskip("torchao.float8")
    out = subprocess.run(
        [
            sys.executable,
            "benchmarks/trainer_mfu.py",
            "--tiny",
            "--fp8",
            "tensorwise",
            "--steps",
            "1",
            "--warmup",
            "1",
            "--compile-backend",
            "aot_eager",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "fp8=tensorwise" in out.stdout and "loss=" in out.stdout
    assert "variant=compile" in out.stdout and "'compile': True" in out.stdout  # the compiled step ran


def test_fp8_trainer_core_pads_packed_rows_to_16(monkeypatch):
    """Through TrainerCore (FSDP2 root, FP8 linears emulated on CPU): `parallelize` marks the
    model, every forward sees a row padded to 16 tokens (FP8 GEMMs need it; an unpadded 2866-token
    row failed on the H200), and the step trains on the real tokens only."""
    pytest.importorskip("torchao.float8")
    import socket

    from rlcore.batch.packing import make_micro_batch
    from rlcore.trainer.core import TrainerCore
    from rlcore.trainer.forward import token_multiple
    from rlcore.types import Sample

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        monkeypatch.setenv("MASTER_PORT", str(sock.getsockname()[1]))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    core = TrainerCore(compose(["trainer.fp8=tensorwise"]), 0, 1)  # CPU: parallelize emulates FP8
    try:
        assert token_multiple(core.model) == 16
        assert type(core.model.model.layers[0].mlp.up_proj).__name__ == "Float8Linear"
        seen = []
        core.model.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["input_ids"].shape[1]), with_kwargs=True)
        samples = [
            Sample(
                prompt_ids=[1, 10, 11],
                completion_ids=[20, 21, 2],
                logprobs=[-4.6] * 3,
                versions=[0] * 3,
                loss_mask=[1] * 3,
            ),
            Sample(
                prompt_ids=[1, 30, 31, 32],
                completion_ids=[33, 2],
                logprobs=[-4.6] * 2,
                versions=[0] * 2,
                loss_mask=[1] * 2,
            ),
        ]
        result = core.train_step([make_micro_batch(samples, [1.0, -1.0])], normalizer=5.0)
        assert seen == [16]  # 12 real tokens + a 4-token pad sample
        assert result.metrics["loss_tokens"] == 5 and result.metrics["train_tokens"] == 12
        assert torch.isfinite(torch.tensor(result.metrics["loss"]))
    finally:
        core.shutdown()


# ---------------------------------------------------------------- vLLM engine plumbing (no vLLM)


class _FakeLLM:
    """The few AsyncLLM methods VLLMEngine's weight paths touch."""

    def __init__(self):
        self.rpcs = []
        self.engine_core = None

    async def collective_rpc(self, method, timeout=None, kwargs=None):
        self.rpcs.append((method, kwargs or {}))
        return [0.0]

    async def pause_generation(self, **kw):
        pass

    async def resume_generation(self):
        pass

    async def reset_prefix_cache(self):
        pass

    def shutdown(self):
        pass


@pytest.fixture
def fake_engine(monkeypatch):
    from rlcore.engine.vllm.vllm_engine import VLLMEngine

    async def _start(self):
        self._update_lock = asyncio.Lock()
        return _FakeLLM()

    monkeypatch.setattr(VLLMEngine, "_start", _start)
    engines = []

    def make(**kw):
        engines.append(VLLMEngine("/nonexistent", **kw))
        return engines[-1]

    yield make
    for e in engines:
        e.shutdown()


def test_vllm_engine_passes_quantization_and_refuses_direct_reload(fake_engine):
    from rlcore.engine.vllm.vllm_engine import VLLMEngine

    e = fake_engine(quantization="fp8")
    assert e._engine_args["quantization"] == "fp8" and e.reload == "layerwise"
    assert "quantization" not in fake_engine()._engine_args  # bf16 engines keep vLLM's defaults
    with pytest.raises(ValueError, match="layerwise"):
        VLLMEngine("/nonexistent", quantization="fp8", reload="direct")
    e.reload = "direct"  # switched after construction (the GPU tests do this): refused at sync time
    with pytest.raises(ValueError, match="re-quantization"):
        e.receive_weights({}, version=1)
    e.reload = "layerwise"
    e.receive_weights({"names": []}, version=1)
    assert [m for m, _ in e._llm.rpcs] == ["start_weight_update", "update_weights", "finish_weight_update"]


def test_vllm_engine_rpc_load_is_layerwise_when_quantized(fake_engine):
    for quant, layerwise in ((None, False), ("fp8", True)):
        e = fake_engine(quantization=quant)
        e.apply_weights([("w", torch.ones(2))], version=3)
        ((method, kwargs),) = e._llm.rpcs
        assert method == "rlcore_load_weights" and kwargs["layerwise"] is layerwise and e.policy_version == 3


def test_vllm_engine_from_config_takes_rollout_quantization(monkeypatch):
    from rlcore.engine.vllm.vllm_engine import VLLMEngine

    seen = {}
    monkeypatch.setattr(VLLMEngine, "__init__", lambda self, path, **kw: seen.update(kw))
    cfg = compose([*GPU, "rollout.vllm.quantization=fp8"])
    VLLMEngine.from_config(cfg.rollout.vllm, cfg.model)
    assert seen["quantization"] == "fp8" and seen["load_format"] == "dummy"
    seen.clear()
    cfg = compose(GPU)
    VLLMEngine.from_config(cfg.rollout.vllm, cfg.model)
    assert "quantization" not in seen


def test_worker_load_weights_wraps_layerwise_reload(monkeypatch):
    """rlcore_load_weights(layerwise=True) brackets load_weights with vLLM's layerwise reload."""
    from rlcore.engine.vllm.vllm_codec import pack_tensor
    from rlcore.engine.vllm.vllm_worker import RLCoreWorkerExtension

    calls = []
    reload_mod = types.ModuleType("vllm.model_executor.model_loader.reload")
    reload_mod.initialize_layerwise_reload = lambda m: calls.append("init")
    reload_mod.finalize_layerwise_reload = lambda m, c: calls.append(("finalize", c))
    for name in ("vllm", "vllm.model_executor", "vllm.model_executor.model_loader"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "vllm.model_executor.model_loader.reload", reload_mod)
    monkeypatch.setattr(torch.accelerator, "synchronize", lambda *a: None)

    class Model(torch.nn.Linear):
        def load_weights(self, named):
            calls.append(("load", [n for n, _ in named]))

    worker = RLCoreWorkerExtension()
    worker.model_runner = types.SimpleNamespace(model=Model(2, 2), model_config="cfg")
    assert worker.rlcore_load_weights([("weight", pack_tensor(torch.zeros(2, 2)))], layerwise=True) == 1
    assert calls == ["init", ("load", ["weight"]), ("finalize", "cfg")]
    calls.clear()
    worker.rlcore_load_weights([("weight", pack_tensor(torch.zeros(2, 2)))])
    assert calls == [("load", ["weight"])]
