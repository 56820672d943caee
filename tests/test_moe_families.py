"""One MoE layer for every routed-expert family (`rlcore.models.moe_family`, `rlcore.trainer.moe`),
on the tiny random configs under conf/model/: the layer equals the family's own transformers
block (forward and gradients, per-expert loop and grouped GEMM), routing replay agrees 1.0 with the
CPU engine's routing on shared weights, an export carries the family's checkpoint names and
reloads with equal logits, and the config checks know each family's keys and refusals.
Expert parallelism against one rank: tests/test_trainer_scale.py (every family in one spawn)."""

from __future__ import annotations

import copy

import pytest
import torch
import yaml
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from rlcore.batch.packing import make_micro_batch
from rlcore.config import ModelConfig
from rlcore.engine.base import SamplingParams
from rlcore.engine.hf_engine import HFEngine
from rlcore.models.build import build_model, build_tokenizer
from rlcore.models.moe_family import moe_problem
from rlcore.plan.compose import REPO, compose
from rlcore.trainer.forward import forward_logprobs
from rlcore.trainer.logprobs import install_logprob_head
from rlcore.trainer.moe import MoEBlock, apply_expert_parallel, router_metrics
from rlcore.types import Sample

FAMILIES = {  # conf/model name -> (router kind, dense first layers)
    "tiny_moe_char": ("softmax_topk", 0),
    "tiny_mixtral_char": ("softmax_topk", 0),
    "tiny_gpt_oss_char": ("topk_softmax", 0),
    "tiny_deepseek_v3_char": ("sigmoid_group", 1),
    "tiny_glm4_moe_char": ("sigmoid_group", 1),
}
NEW = [n for n in FAMILIES if n != "tiny_moe_char"]  # tests/test_routing_replay.py covers Qwen3-MoE's replay


def family(name: str):
    """(ModelConfig, tokenizer, model) with larger random weights (routing-sensitive) and, for a
    sigmoid router, a non-zero correction bias."""
    cfg = ModelConfig(**yaml.safe_load((REPO / "conf" / "model" / f"{name}.yaml").read_text()))
    tok = build_tokenizer(cfg)
    model = build_model(cfg, tok)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
        for n, b in model.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.1)
    return cfg, tok, model


@pytest.mark.parametrize("name", list(FAMILIES))
def test_moe_layer_equals_the_family_block(name):
    _, tok, ref = family(name)
    model = copy.deepcopy(ref)
    blocks = apply_expert_parallel(model, None)
    kind, dense = FAMILIES[name]
    assert {b.kind for b in blocks} == {kind} and blocks[0].layer_index == dense
    assert sorted(model.state_dict()) == sorted(ref.state_dict())  # the transformers names, buffers too
    ids = torch.randint(0, len(tok), (2, 11), generator=torch.Generator().manual_seed(2))
    ref_logits = ref(input_ids=ids).logits
    seed = torch.randn(ref_logits.shape, generator=torch.Generator().manual_seed(3))
    (ref_logits * seed).sum().backward()
    for grouped in (False, True):  # the per-expert loop, then torch._grouped_mm (its CPU kernel)
        for b in blocks:
            b.experts.grouped = grouped
        model.zero_grad()
        logits = model(input_ids=ids).logits
        torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-5)
        (logits * seed).sum().backward()
        grads = dict(model.named_parameters())
        for n, p in ref.named_parameters():
            torch.testing.assert_close(grads[n].grad, p.grad, atol=1e-5, rtol=1e-4, msg=f"{name} grouped={grouped} {n}")
    stats = router_metrics(model)
    assert stats["moe_load_imbalance"] >= 1.0 and stats["moe_router_entropy"] > 0


@pytest.mark.parametrize("name", NEW)
def test_a_packed_row_gives_each_sample_its_own_logprobs(name):
    """gpt-oss's transformers model does not find packed sequences itself (rlcore.trainer.packed_mask)."""
    _, tok, model = family(name)
    apply_expert_parallel(model, None)
    install_logprob_head(model, 0)
    g = torch.Generator().manual_seed(4)
    samples = [
        Sample(torch.randint(1, len(tok), (n,), generator=g).tolist(), [7, 8, 9, 10], [0.0] * 4, [0] * 4, [1] * 4)
        for n in (30, 21)
    ]  # past the 16-token sliding window
    with torch.no_grad():
        packed, _ = forward_logprobs(model, make_micro_batch(samples, [1.0, 1.0]), 1.0, None, torch.device("cpu"))
        alone = [
            forward_logprobs(model, make_micro_batch([s], [1.0]), 1.0, None, torch.device("cpu"))[0] for s in samples
        ]
    torch.testing.assert_close(packed, torch.cat(alone), atol=1e-5, rtol=1e-5)
    router_metrics(model)


def test_a_block_with_a_part_rlcore_does_not_compute_is_refused():
    _, _, model = family("tiny_glm4_moe_char")
    model.model.layers[1].mlp.extra_gate = torch.nn.Linear(64, 1)
    with pytest.raises(ValueError, match=r"glm4_moe: .*\['extra_gate'\]"):
        apply_expert_parallel(model, None)


@pytest.mark.parametrize("name", NEW)
def test_replay_agreement_is_one_on_shared_weights(name):
    cfg, tok, model = family(name)
    engine = HFEngine(model, tok.pad_token_id, tok.eos_token_id, seed=1, routing_replay=True)
    policy = copy.deepcopy(engine.model)
    blocks = apply_expert_parallel(policy, None)
    install_logprob_head(policy, 64)
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]
    gens = engine.generate(prompts, SamplingParams(max_new_tokens=6, temperature=1.0, seed=3))
    layers = cfg.arch["num_hidden_layers"]
    for p, g in zip(prompts, gens):
        assert g.routed_experts.shape == (len(p) + len(g.token_ids) - 1, layers, 2)
    samples = [
        Sample(p, g.token_ids, g.logprobs, g.versions, [1] * len(g.token_ids), routed_experts=g.routed_experts)
        for p, g in zip(prompts, gens)
    ]
    mb = make_micro_batch(samples, [1.0, -1.0])
    lp_replay, _ = forward_logprobs(policy, mb, 1.0, None, torch.device("cpu"))
    assert router_metrics(policy)["moe_replay_agreement"] == 1.0
    mb.routed_experts = None  # the trainer's own routing: the same experts and weights
    lp_self, _ = forward_logprobs(policy, mb, 1.0, None, torch.device("cpu"))
    torch.testing.assert_close(lp_replay, lp_self)
    # the replayed weights of other experts are the family's router weights there, with a gradient
    b = blocks[-1]
    x = torch.randn(3, 64)
    logits, w_own, e_own = b.route_module()(x)
    b.replay = (e_own + 1) % b.num_experts
    w, e = b._replayed(logits, w_own, e_own)
    b.replay = None
    assert torch.equal(e, (e_own + 1) % b.num_experts)
    (w * torch.arange(1.0, 3.0)).sum().backward()
    assert b.route_module().weight.grad.abs().sum() > 0
    router_metrics(policy)


@pytest.mark.parametrize("name", NEW)
def test_export_has_the_family_checkpoint_names_and_reloads(name, tmp_path):
    from types import SimpleNamespace

    from rlcore.storage import checkpoint as ckpt
    from rlcore.storage.export import export_checkpoint
    from rlcore.trainer.schedule import build_scheduler

    cfg = compose([f"output_dir={tmp_path / 'run'}", f"model={name}"])
    _, tok, model = family(name)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    core = SimpleNamespace(
        model=model,
        optimizer=opt,
        scheduler=build_scheduler(opt, cfg.trainer, 10),
        rank=0,
        world_size=1,
        version=1,
        cfg=cfg,
        tokenizer=tok,
    )
    writer = ckpt.CheckpointWriter(cfg)
    tmp = writer.begin(1)
    path = writer.commit(tmp, 1, {"kind": "rl", "step": 1}, ckpt.save_trainer(core, tmp))
    out = export_checkpoint(path, tmp_path / "hf")
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    # what save_pretrained writes for this family (vLLM's loaders read these names)
    model.save_pretrained(tmp_path / "ref")
    with safe_open(str(tmp_path / "ref" / "model.safetensors"), "pt") as f:
        assert names == set(f.keys())
    fused = any(n.endswith("experts.gate_up_proj") for n in names)
    assert fused == (name == "tiny_gpt_oss_char")  # gpt-oss checkpoints keep fused experts; the others split them
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.tensor([[1, 5, 9, 14, 3, 7]])
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, model.eval()(ids).logits, atol=1e-6, rtol=1e-6)


def test_config_checks_know_each_family(tmp_path):
    from rlcore.plan.validate import problems

    def keys(*over):
        return dict(problems(compose([f"output_dir={tmp_path}", *over])))

    for name in NEW:  # every family's expert-count key: ep=2 of 4 experts, replay
        found = keys(f"model={name}", "trainer.world_size=2", "trainer.ep=2", "rollout.hf.routing_replay=true")
        assert "trainer.ep" not in found and "rollout.hf.routing_replay" not in found, (name, found)
        found = keys(f"model={name}", "trainer.world_size=8", "trainer.ep=8")
        assert "num_experts=4" in found["trainer.ep"], (name, found)
    assert (
        "context parallelism" in keys("model=tiny_gpt_oss_char", "trainer.world_size=2", "trainer.cp=2")["trainer.cp"]
    )
    found = keys(
        "model=tiny_moe_char",
        "model.arch.model_type=olmoe",
        "trainer.world_size=2",
        "trainer.ep=2",
        "rollout.hf.routing_replay=true",
    )
    assert "'olmoe' is a mixture-of-experts family rlcore has no MoE adapter for" in found["trainer.ep"]
    assert "olmoe" in found["rollout.hf.routing_replay"]
    assert moe_problem({"model_type": "glm4_moe", "n_routed_experts": 6, "num_experts_per_tok": 2, "n_group": 4})
    assert moe_problem({"model_type": "qwen3", "hidden_size": 8}) is None  # dense


def test_dense_first_layers_stay_dense():
    _, _, model = family("tiny_glm4_moe_char")
    apply_expert_parallel(model, None)
    layers = model.model.layers
    assert not isinstance(layers[0].mlp, MoEBlock) and isinstance(layers[1].mlp, MoEBlock)
    assert layers[1].mlp.shared_name == "shared_experts"


@pytest.mark.integration
def test_cli_runs_every_family_with_replay_and_exports(tmp_path):
    """`python -m rlcore.run` (one multirun sweep: Mixtral, gpt-oss, DeepSeek-V3, GLM-4.5): 3 RL
    steps each with routing replay, the accounting identity on every row, agreement 1.0 on the
    on-policy first step, and the final export (family checkpoint names) equal to the export of
    the final checkpoint, reloading in transformers."""
    import json
    import subprocess
    import sys

    names = ["tiny_mixtral_char", "tiny_gpt_oss_char", "tiny_deepseek_v3_char", "tiny_glm4_moe_char"]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlcore.run",
            "-m",
            "model=" + ",".join(names),
            "steps=3",
            "rollout.hf.routing_replay=true",
            "sft.warmup_steps=0",
            "rollout.sampling.max_new_tokens=6",
            "algo.group_size=4",
            "algo.batch_groups=2",
            f"output_dir={tmp_path}/run",
            "logger.console=false",
            "checkpoint.export_final=true",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    from rlcore.storage.checkpoint_dirs import latest_checkpoint
    from rlcore.storage.export import export_checkpoint

    for i, name in enumerate(names):
        out = tmp_path / "run" / str(i)
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == [1, 2, 3], name
        for r in rows:
            assert r["samples_generated"] == (
                r["samples_trained"]
                + r["samples_dropped_stale"]
                + r["samples_failed"]
                + r["samples_in_flight"]
                + r["samples_filtered"]
            ), (name, r)
            assert 0.0 < r["moe_replay_agreement"] <= 1.0 and r["moe_load_imbalance"] >= 1.0, (name, r)
        assert rows[0]["moe_replay_agreement"] == 1.0, name  # version 0 on both sides
        assert rows[0]["mismatch_kl"] < 1e-6, name  # same weights: engine and trainer agree (gpt-oss's masks)
        final = export_checkpoint(latest_checkpoint(out / "checkpoints"), tmp_path / f"ckpt_hf_{i}")
        with (
            safe_open(str(out / "hf" / "model.safetensors"), "pt") as a,
            safe_open(str(final / "model.safetensors"), "pt") as b,
        ):
            assert set(a.keys()) == set(b.keys()), name
            for k in a.keys():
                assert torch.equal(a.get_tensor(k), b.get_tensor(k)), (name, k)
        reloaded = AutoModelForCausalLM.from_pretrained(out / "hf").eval()
        with torch.no_grad():
            assert torch.isfinite(reloaded(torch.tensor([[1, 5, 9, 14]])).logits).all()
