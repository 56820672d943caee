import torch

from rlcore.engine.base import SamplingParams
from rlcore.engine.hf_engine import HFEngine, sample_with_logprobs
from rlcore.models.build import build_model, build_tokenizer


def engine(cfg, scale=3.0):
    tok = build_tokenizer(cfg.model)
    model = build_model(cfg.model, tok)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(scale)
    return HFEngine(model, tok.pad_token_id, tok.eos_token_id, seed=0), tok


def test_generated_logprobs_match_teacher_forcing(tiny_cfg):
    eng, _ = engine(tiny_cfg)
    prompts = [[1, 5, 6, 7, 8, 9], [1, 12], [1, 14, 15, 16]]  # ragged: exercises left padding
    gens = eng.generate(prompts, SamplingParams(max_new_tokens=6, temperature=1.0))
    for p, g in zip(prompts, gens):
        assert len(g.token_ids) == len(g.logprobs) == len(g.versions)
        assert g.finish_reason in ("stop", "length")
        assert torch.allclose(torch.tensor(g.logprobs), torch.tensor(eng.score(p, g.token_ids)), atol=1e-4)


def test_temperature_logprobs_are_of_tempered_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    tok, lp = sample_with_logprobs(logits, 0.5, 1.0, torch.Generator().manual_seed(0))
    expected = torch.log_softmax(logits / 0.5, -1)[0, tok[0]]
    assert torch.allclose(lp[0], expected)


def test_top_p_renormalises_the_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    seen = set()
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        tok, lp = sample_with_logprobs(logits, 1.0, 0.7, g)
        seen.add(int(tok))
        # nucleus {0, 1}: renormalised probabilities 0.625 / 0.375
        assert abs(lp.exp().item() - {0: 0.625, 1: 0.375}[int(tok)]) < 1e-5
    assert seen == {0, 1}


def test_stop_and_versions(tiny_cfg):
    eng, tok = engine(tiny_cfg, scale=1.0)
    eng.set_version(7)
    gens = eng.generate([[1, 5]] * 8, SamplingParams(max_new_tokens=50))
    for g in gens:
        assert set(g.versions) == {7}
        if g.finish_reason == "stop":
            assert g.token_ids[-1] == tok.eos_token_id
        else:
            assert len(g.token_ids) == 50


def test_weights_apply_and_state_dict(tiny_cfg):
    eng, _ = engine(tiny_cfg, scale=1.0)
    new = {k: torch.full_like(v, 0.01) for k, v in eng.state_dict().items()}
    eng.apply_weights(new.items(), version=3)
    assert eng.policy_version == 3
    assert all(torch.equal(v, new[k]) for k, v in eng.state_dict().items())
