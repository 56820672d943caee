"""Rollout routing replay against vLLM on one GPU: a random-weight Qwen3-MoE model, the same bf16
weights in vLLM (loaded by trainer name, as a sync does) and in the trainer's MoE blocks. vLLM's
routed experts per token (`enable_return_routed_experts`) have the rows `rlcore.batch.routing` documents,
and the replayed trainer forward uses exactly those experts. Prints the engine-vs-trainer
logprob gap with and without replay. Run on the lent machine from the repo root:

    python -m pytest -m gpu tests/gpu/test_routing_replay_gpu.py -v -s
"""

from __future__ import annotations

import importlib.util
import tempfile

import pytest

pytestmark = [
    pytest.mark.gpu(gpus=1),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm"),
]

SHAPE = dict(
    hidden_size=512,
    intermediate_size=1024,
    moe_intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    num_experts=32,
    num_experts_per_tok=4,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    vocab_size=512,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
)


@pytest.fixture(scope="module")
def setup():
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from rlcore.engine.vllm.vllm_engine import VLLMEngine
    from rlcore.trainer.attention import use_varlen_attention
    from rlcore.trainer.logprobs import install_logprob_head
    from rlcore.trainer.moe import apply_expert_parallel

    path = tempfile.mkdtemp(prefix="rlcore-moe-replay-")
    cfg = Qwen3MoeConfig(**SHAPE)
    cfg.architectures = ["Qwen3MoeForCausalLM"]
    cfg.save_pretrained(path)
    torch.manual_seed(0)
    policy = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).cuda()
    engine = VLLMEngine(
        path,
        load_format="dummy",
        enforce_eager=True,
        gpu_memory_utilization=0.3,
        max_model_len=1024,
        enable_return_routed_experts=True,
        rpc_timeout_s=120,
    )
    try:
        engine.load_weights((n, p.detach()) for n, p in policy.named_parameters())
        engine.set_version(1)
        blocks = apply_expert_parallel(policy, None)
        use_varlen_attention(policy, None)  # packed rows: explicit sample boundaries, as the trainer runs
        install_logprob_head(policy, 4096)
        yield engine, policy, blocks
    finally:
        engine.shutdown()


def test_vllm_routing_is_what_the_replayed_forward_uses(setup, monkeypatch):
    import numpy as np
    import torch

    from rlcore.batch.packing import make_micro_batch
    from rlcore.batch.routing import expected_rows
    from rlcore.engine.base import SamplingParams
    from rlcore.trainer.forward import forward_logprobs
    from rlcore.trainer.moe import router_metrics
    from rlcore.types import Sample

    engine, policy, blocks = setup
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 512, size=n).tolist() for n in (17, 40, 64, 23)]
    gens = engine.generate(prompts, SamplingParams(max_new_tokens=48, temperature=1.0, seed=5))
    samples = []
    for p, g in zip(prompts, gens):
        r = np.asarray(g.routed_experts)
        assert r.shape == (
            expected_rows(len(p), len(g.token_ids)),
            SHAPE["num_hidden_layers"],
            SHAPE["num_experts_per_tok"],
        ), (r.shape, len(p), len(g.token_ids))
        samples.append(Sample(p, g.token_ids, g.logprobs, g.versions, [1] * len(g.token_ids), routed_experts=r))
    mb = make_micro_batch(samples, [1.0] * len(samples))

    used = {}
    for b in blocks:
        orig = b._replayed

        def spy(logits, weights, experts, _b=b, _orig=orig):
            w, e = _orig(logits, weights, experts)
            used[_b.layer_index] = e.detach().cpu().clone()
            return w, e

        monkeypatch.setattr(b, "_replayed", spy)

    dev = torch.device("cuda")
    with torch.enable_grad():  # the agreement metric counts grad-enabled forwards, as training does
        lp_replay, _ = forward_logprobs(policy, mb, 1.0, None, dev)
    agreement = router_metrics(policy)["moe_replay_agreement"]
    given = mb.routed_experts.long()
    rows = (given >= 0).all(-1).all(-1)
    assert int(rows.sum()) == sum(expected_rows(len(s.prompt_ids), len(s.completion_ids)) for s in samples)
    for layer in range(SHAPE["num_hidden_layers"]):
        assert torch.equal(used[layer][rows], given[rows, layer]), f"layer {layer}"

    routed = mb.routed_experts
    mb.routed_experts = None
    with torch.no_grad():
        lp_self, _ = forward_logprobs(policy, mb, 1.0, None, dev)
    mb.routed_experts = routed
    mask = mb.loss_mask.bool()
    behaviour = mb.behaviour_logprobs[mask]
    gap_replay = (lp_replay.detach().float().cpu()[mask] - behaviour).abs()
    gap_self = (lp_self.float().cpu()[mask] - behaviour).abs()
    print(
        f"\nrouting replay: vLLM vs trainer over {int(mask.sum())} tokens: agreement of vLLM's experts with "
        f"the trainer's own top-k {agreement:.4f}; |logprob gap| mean/max with replay "
        f"{gap_replay.mean():.4f}/{gap_replay.max():.4f}, without {gap_self.mean():.4f}/{gap_self.max():.4f}"
    )
    assert 0.5 < agreement <= 1.0
