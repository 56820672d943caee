"""Hybrid models (Qwen3-Next: Gated DeltaNet + attention + MoE; Nemotron-H: Mamba-2 + attention +
MLP), tiny random configs (`conf/model/tiny_qwen3_next.yaml`, `tiny_nemotron_h.yaml`): the CPU
engine generates with each layer's own state, and packed training restarts the recurrent state
at every packed sample."""

import socket

import pytest
import torch

from rlcore.batch.packing import make_micro_batch
from rlcore.engine.base import SamplingParams
from rlcore.engine.hf_engine import HFEngine
from rlcore.models.build import build_model, build_tokenizer
from rlcore.models.hybrid import recurrent_mixers
from rlcore.plan.compose import compose
from rlcore.types import Sample

HYBRIDS = ["tiny_qwen3_next", "tiny_nemotron_h"]


def sample(p, c):
    return Sample(
        prompt_ids=p, completion_ids=c, logprobs=[-0.5] * len(c), versions=[0] * len(c), loss_mask=[1] * len(c)
    )


def sharpen(model):
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3.0)  # a context-sensitive model, so a leaked state shows


@pytest.mark.parametrize("name", HYBRIDS)
def test_engine_generates_with_each_layers_state(name):
    cfg = compose([f"model={name}"])
    tok = build_tokenizer(cfg.model)
    model = build_model(cfg.model, tok)
    assert recurrent_mixers(model), "the tiny config has no recurrent layer"
    sharpen(model)
    eng = HFEngine(model, tok.pad_token_id, tok.eos_token_id, seed=0)
    prompts = [[1, 5, 6, 7, 8, 9], [1, 12], [1, 14, 15, 16]]  # ragged: left padding must not enter a state
    gens = eng.generate(prompts, SamplingParams(max_new_tokens=6, temperature=1.0))
    for p, g in zip(prompts, gens):
        assert len(g.token_ids) == len(g.logprobs) > 0
        assert torch.allclose(torch.tensor(g.logprobs), torch.tensor(eng.score(p, g.token_ids)), atol=1e-3)


@pytest.mark.parametrize("name", HYBRIDS)
def test_packed_logprobs_equal_each_sample_alone(name, tmp_path, monkeypatch):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    from rlcore.trainer.core import TrainerCore

    core = TrainerCore(compose([f"model={name}", f"output_dir={tmp_path / 'run'}"]), 0, 1)
    try:
        sharpen(core.model)
        samples = [sample([1, 10, 11, 12], [20, 21, 2]), sample([1, 30], [31, 32, 33, 2]), sample([1, 40, 41], [42, 2])]
        mb = make_micro_batch(samples, [0.0] * 3)
        with torch.no_grad():
            packed, _ = core.forward_logprobs(mb)
            single = torch.cat([core.forward_logprobs(make_micro_batch([s], [0.0]))[0] for s in samples])
        mask = mb.loss_mask.bool()
        assert torch.allclose(packed[mask], single[mask], atol=1e-5), (packed[mask] - single[mask]).abs().max()
    finally:
        core.shutdown()
    # the check can fail: transformers' own forward of the same packed row (attention sees the
    # boundaries through the position ids, the recurrent layers do not) leaks state across samples
    cfg = compose([f"model={name}"])
    raw = build_model(cfg.model, build_tokenizer(cfg.model))
    sharpen(raw)
    with torch.no_grad():
        logp = torch.log_softmax(raw(input_ids=mb.input_ids[None], position_ids=mb.position_ids[None]).logits[0], -1)
    leaky = logp.gather(-1, mb.targets[:, None])[:, 0]
    assert not torch.allclose(leaky[mask], single[mask], atol=1e-3)


BIG = {
    "tiny_qwen3_next": [
        "model.arch.hidden_size=512",
        "model.arch.num_hidden_layers=8",
        "model.arch.full_attention_interval=4",
        "model.arch.linear_key_head_dim=64",
        "model.arch.linear_value_head_dim=64",
        "model.arch.num_experts=16",
    ],
    "tiny_nemotron_h": [
        "model.arch.hidden_size=512",
        "model.arch.mamba_num_heads=16",
        "model.arch.mamba_head_dim=32",
        "model.arch.ssm_state_size=64",
        "model.arch.n_groups=2",
    ],
}


@pytest.mark.parametrize("name", HYBRIDS)
@pytest.mark.parametrize("bigger", [False, True])
def test_memory_plan_counts_parameters_and_recurrent_state(name, bigger):
    """The planner's parameter count and per-sequence recurrent state equal the real model's and
    what its cache holds after a forward (conv windows counted at 2 bytes, matrices at 4)."""
    from transformers import DynamicCache

    from rlcore.plan.hybrid_memory import recurrent_state_bytes
    from rlcore.plan.memory import CHAR_VOCAB_BOUND, _arch, engine_min_bytes, max_sequences_per_engine, param_count

    cfg = compose([f"model={name}", *(BIG[name] if bigger else [])])
    tok = build_tokenizer(cfg.model)
    model = build_model(cfg.model, tok)
    # the planner bounds the character vocabulary by CHAR_VOCAB_BOUND: compare without the embedding
    vocab = {id(m.weight): m.weight for m in (model.get_input_embeddings(), model.get_output_embeddings())}
    real = sum(p.numel() for p in model.parameters()) - sum(w.numel() for w in vocab.values())
    planned = param_count(cfg) - len(vocab) * CHAR_VOCAB_BOUND * model.config.hidden_size
    assert abs(planned - real) / real < 0.01, (planned, real)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=torch.tensor([[1, 5, 6, 7, 8]]), use_cache=True, cache=cache)
    held = sum(
        layer.conv_states[0].numel() * 2 + layer.recurrent_states[0].numel() * 4
        for layer in cache.layers
        if hasattr(layer, "conv_states")
    )
    assert held > 0 and recurrent_state_bytes(_arch(cfg)) == held
    dense = compose(["model=tiny_char"])
    assert engine_min_bytes(cfg) - 2 * param_count(cfg) - (
        engine_min_bytes(dense) - 2 * param_count(dense)
    ) == held * max_sequences_per_engine(cfg)


def test_concurrent_generations_keep_their_own_state():
    """Generation slots run several generate calls on one engine at once (their decode steps
    interleave under the model lock): each call's recurrent states are its own, so a seeded call
    gives the same tokens and logprobs beside another as alone."""
    import threading

    from rlcore.engine.slots import GenerationSlots

    cfg = compose(["model=tiny_qwen3_next"])
    tok = build_tokenizer(cfg.model)
    model = build_model(cfg.model, tok)
    sharpen(model)
    eng = GenerationSlots(HFEngine(model, tok.pad_token_id, tok.eos_token_id, seed=0), n=2)
    calls = [([[1, 5, 6, 7], [1, 9]], 11), ([[1, 20, 21, 22, 23, 24]], 12)]
    alone = [eng.generate(p, SamplingParams(max_new_tokens=12, temperature=1.0, seed=s)) for p, s in calls]
    together = [None, None]

    def go(i):
        p, s = calls[i]
        together[i] = eng.generate(p, SamplingParams(max_new_tokens=12, temperature=1.0, seed=s))

    threads = [threading.Thread(target=go, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for a, b in zip(alone, together):
        assert [g.token_ids for g in a] == [g.token_ids for g in b]
        assert [g.logprobs for g in a] == [g.logprobs for g in b]
