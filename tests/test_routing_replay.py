"""Rollout routing replay (R3) on the tiny MoE policy (`conf/model/tiny_moe_char.yaml`): the
transformers engine's routed experts per token, their packing, the trainer's MoE blocks using
them exactly (router gradient kept), the config checks, and one short CLI run with replay on."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
import yaml

from rlcore.batch.packing import make_micro_batch
from rlcore.batch.routing import SELF_ROUTE, aligned, expected_rows, packed_routing
from rlcore.config import ModelConfig
from rlcore.engine.base import SamplingParams
from rlcore.engine.hf_engine import HFEngine
from rlcore.models.build import build_model, build_tokenizer
from rlcore.models.vision import decoder_layers
from rlcore.plan.compose import REPO, compose
from rlcore.trainer.forward import forward_logprobs
from rlcore.trainer.logprobs import install_logprob_head
from rlcore.trainer.moe import apply_expert_parallel, router_metrics
from rlcore.types import Sample

CONF = REPO / "conf" / "model" / "tiny_moe_char.yaml"


@pytest.fixture(scope="module")
def moe():
    """(engine with routing capture, trainer-side model with MoE blocks, same weights, tokenizer)."""
    torch.manual_seed(0)
    cfg = ModelConfig(**yaml.safe_load(CONF.read_text()))
    tok = build_tokenizer(cfg)
    engine = HFEngine(build_model(cfg, tok), tok.pad_token_id, tok.eos_token_id, seed=1, routing_replay=True)
    policy = build_model(cfg, tok)
    policy.load_state_dict(engine.model.state_dict())
    blocks = apply_expert_parallel(policy, None)
    install_logprob_head(policy, 64)
    return engine, policy, blocks, tok


def own_topk(model, ids: list[int]) -> np.ndarray:
    """[len(ids), layers, k]: each router's own top-k over a teacher-forced forward of `ids`."""
    got = {}
    hooks = [
        layer.mlp.gate.register_forward_hook(lambda m, a, out, i=i: got.__setitem__(i, out[-1]))
        for i, layer in enumerate(decoder_layers(model))
    ]
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([ids]), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return torch.stack([got[i] for i in sorted(got)], 1).numpy()


def generate(engine, prompts, n=7):
    return engine.generate(prompts, SamplingParams(max_new_tokens=n, temperature=1.0, seed=3))


def test_engine_returns_the_routing_of_every_token_it_ran(moe):
    engine, _, _, _ = moe
    prompts = [[5, 6, 7, 8, 9], [10, 11]]  # different lengths: left padding must not shift rows
    for p, g in zip(prompts, generate(engine, prompts)):
        assert g.routed_experts.shape == (expected_rows(len(p), len(g.token_ids)), 2, 2)
        assert g.routed_experts.dtype == np.uint8
        # a teacher-forced forward over prompt + completion[:-1] routes every token the same way
        ref = own_topk(engine.model, p + g.token_ids[:-1])
        np.testing.assert_array_equal(np.sort(g.routed_experts, -1), np.sort(ref, -1))


def test_packing_carries_routing_with_self_route_rows():
    r = np.arange(2 * 3 * 2 * 2).reshape(6, 2, 2).astype(np.uint8) % 4  # 3 prompt + 4 completion - 1
    a = Sample([1, 2, 3], [4, 5, 6, 7], [0.0] * 4, [0] * 4, [1] * 4, routed_experts=r)
    b = Sample([1, 2], [3], [0.0], [0], [1])  # no routing: routes itself
    mb = make_micro_batch([a, b], [1.0, 1.0])
    assert mb.routed_experts.dtype == torch.int16 and mb.routed_experts.shape == (10, 2, 2)
    np.testing.assert_array_equal(mb.routed_experts[:6].numpy(), r)
    assert (mb.routed_experts[6:] == SELF_ROUTE).all()  # a's last token, and all of b
    assert make_micro_batch([b], [1.0]).routed_experts is None
    assert packed_routing([]) is None
    # a short or long engine array is cut or filled, never shifted
    assert (aligned(r[:2], 4, 2, 2)[2:] == SELF_ROUTE).all() and len(aligned(r, 3, 2, 2)) == 3
    with pytest.raises(ValueError, match="expected"):
        aligned(r[:, :1], 7, 2, 2)


def replayed_experts(blocks, monkeypatch) -> dict[int, torch.Tensor]:
    """Capture the experts each block used (its `_replayed` result) in the next forward."""
    used = {}
    for b in blocks:
        orig = b._replayed

        def spy(logits, weights, experts, _b=b, _orig=orig):
            w, e = _orig(logits, weights, experts)
            used[_b.layer_index] = e.detach().clone()
            return w, e

        monkeypatch.setattr(b, "_replayed", spy)
    return used


def test_replayed_forward_uses_the_engine_routing_exactly(moe, monkeypatch):
    engine, policy, blocks, _ = moe
    prompts = [[5, 6, 7, 8], [12, 13, 14]]
    samples = [
        Sample(p, g.token_ids, g.logprobs, g.versions, [1] * len(g.token_ids), routed_experts=g.routed_experts)
        for p, g in zip(prompts, generate(engine, prompts))
    ]
    mb = make_micro_batch(samples, [1.0, -1.0])
    used = replayed_experts(blocks, monkeypatch)
    lp_replay, _ = forward_logprobs(policy, mb, 1.0, None, torch.device("cpu"))
    given = mb.routed_experts.long()
    rows = (given >= 0).all(-1).all(-1)
    for layer, e in used.items():
        assert torch.equal(e[rows], given[rows, layer])
    assert router_metrics(policy)["moe_replay_agreement"] == 1.0  # same weights, fp32: same top-k
    # replaying the trainer's own routing changes nothing
    mb.routed_experts = None
    lp_self, _ = forward_logprobs(policy, mb, 1.0, None, torch.device("cpu"))
    torch.testing.assert_close(lp_replay, lp_self)
    router_metrics(policy)


def test_given_experts_replace_the_top_k_and_the_router_keeps_its_gradient(moe, monkeypatch):
    _, policy, blocks, _ = moe
    ids = [3, 4, 5, 6, 7, 8]
    own = own_topk(policy, ids)
    # the two experts the router did not pick (top-2 of 4), for every token and layer
    picked = (own[..., :, None] == np.arange(4)).any(-2)  # [T, layers, 4]
    other = np.argsort(picked, -1, kind="stable")[..., :2]
    assert not (other[..., :, None] == own[..., None, :]).any()
    s = Sample(ids[:3], ids[3:], [0.0] * 3, [0] * 3, [1] * 3, routed_experts=other[:-1].astype(np.uint8))
    mb = make_micro_batch([s], [1.0])
    used = replayed_experts(blocks, monkeypatch)
    policy.zero_grad()
    lp, _ = forward_logprobs(policy, mb, 1.0, None, torch.device("cpu"))
    (-lp[2:5].sum()).backward()
    for layer, e in used.items():
        torch.testing.assert_close(e[:-1], torch.from_numpy(other[:-1, layer]).long())
        gate = blocks[layer].gate.weight.grad
        assert gate is not None and gate.abs().sum() > 0
    metrics = router_metrics(policy)
    assert metrics["moe_replay_agreement"] == 0.0
    # the weights are the router's probabilities at the given experts, renormalised
    b = blocks[0]
    x = torch.randn(4, 64)
    logits, w_own, e_own = b.gate(x)
    b.replay = torch.tensor([[0, 1], [2, 3], [-1, -1], [3, 0]])
    w, e = b._replayed(logits, w_own, e_own)
    p = torch.softmax(logits.float(), -1)
    assert torch.equal(e[2], e_own[2]) and torch.equal(w[2], w_own[2])
    torch.testing.assert_close(w[0], p[0, [0, 1]] / p[0, [0, 1]].sum())
    b.replay = None
    router_metrics(policy)


@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_replay_needs_a_moe_model(tmp_path, engine):
    from rlcore.plan.validate import problems

    base = [f"output_dir={tmp_path}", f"rollout.engine={engine}", f"rollout.{engine}.routing_replay=true"]
    if engine == "vllm":
        base += ["rollout.gpus_per_actor=1"]
    found = problems(compose(base))
    assert f"rollout.{engine}.routing_replay" in [k for k, _ in found], found
    assert not [k for k, _ in problems(compose(base + ["model=tiny_moe_char"])) if "routing_replay" in k]


def test_replay_on_a_dense_model_is_one_line_exit_2(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "rlcore.run", f"output_dir={tmp_path}", "rollout.hf.routing_replay=true"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[0].startswith("rlcore: config error: rollout.hf.routing_replay")


@pytest.mark.integration
def test_cli_run_with_replay(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlcore.run",
            "model=tiny_moe_char",
            "rollout.hf.routing_replay=true",
            "steps=2",
            "sft.warmup_steps=0",
            "rollout.sampling.max_new_tokens=8",
            "algo.group_size=4",
            "algo.batch_groups=2",
            f"output_dir={out}",
            "logger.console=false",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    # step 1 is on-policy: the trainer's own top-k is the engine's; later steps drift little
    assert all(0.5 < r["moe_replay_agreement"] <= 1.0 for r in rows), [r.get("moe_replay_agreement") for r in rows]
