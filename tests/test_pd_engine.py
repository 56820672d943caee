"""Prefill/decode disaggregation at the engine level (`rlcore.engine.hf_engine`): a decode engine
continuing a prefill engine's cache samples what one engine alone samples."""

import pickle

import pytest
import torch

from rlcore.engine.base import SamplingParams, StalePrefill
from rlcore.engine.hf_engine import HFEngine
from rlcore.models.build import build_model, build_tokenizer

PROMPTS = [[1, 5, 6, 7, 8, 9], [1, 12], [1, 14, 15, 16]]  # ragged: left padding in the handed cache


def pair(cfg):
    """Two engines of one model's weights (a prefill and a decode engine), different engine seeds."""
    tok = build_tokenizer(cfg.model)
    model = build_model(cfg.model, tok)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3.0)  # peaked enough that completions differ by prompt
    other = build_model(cfg.model, tok)
    other.load_state_dict(model.state_dict())
    return (
        HFEngine(model, tok.pad_token_id, tok.eos_token_id, seed=1),
        HFEngine(other, tok.pad_token_id, tok.eos_token_id, seed=2),
    )


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_decode_from_prefill_equals_one_engine(tiny_cfg, temperature):
    prefill, decode = pair(tiny_cfg)
    params = SamplingParams(max_new_tokens=10, temperature=temperature, seed=123)
    alone = decode.generate(PROMPTS, params)
    handle = pickle.loads(pickle.dumps(prefill.prefill(PROMPTS, params)))  # as the object store carries it
    split = decode.generate(PROMPTS, params, prefilled=handle)
    assert [g.token_ids for g in split] == [g.token_ids for g in alone]
    assert [g.logprobs for g in split] == [g.logprobs for g in alone]  # bitwise: the same ops on the same cache
    assert [g.finish_reason for g in split] == [g.finish_reason for g in alone]
    if temperature:
        assert len({tuple(g.token_ids) for g in alone}) > 1  # the prompts' completions differ


def test_decode_only_on_the_prefill_version(tiny_cfg):
    """A handle decodes only on weights of its own version: both directions of a mismatch are
    refused before the cache meets the weights; on one version every token carries it."""
    prefill, decode = pair(tiny_cfg)
    params = SamplingParams(max_new_tokens=5, temperature=1.0, seed=7)
    for p_version, d_version in ((3, 4), (4, 3)):
        prefill.set_version(p_version)
        decode.set_version(d_version)
        with pytest.raises(StalePrefill, match=f"prefill at version {p_version}, this engine holds {d_version}"):
            decode.generate(PROMPTS, params, prefilled=prefill.prefill(PROMPTS, params))
    prefill.set_version(4)
    decode.set_version(4)
    gens = decode.generate(PROMPTS, params, prefilled=prefill.prefill(PROMPTS, params))
    assert all(g.versions == [4] * len(g.token_ids) and len(g.token_ids) > 1 for g in gens)


def test_handle_of_other_prompts_is_refused(tiny_cfg):
    prefill, decode = pair(tiny_cfg)
    params = SamplingParams(max_new_tokens=3)
    with pytest.raises(ValueError, match="other prompts"):
        decode.generate(PROMPTS[:2], params, prefilled=prefill.prefill(PROMPTS, params))


def test_decode_continues_the_handed_cache(tiny_cfg):
    """The decode engine samples its first token from the prefill's logits and attends to its
    cache: with other weights on the prefill side, the first token's logprob is the prefill
    engine's own, not the decode engine's."""
    prefill, decode = pair(tiny_cfg)
    with torch.no_grad():
        for p in prefill.model.parameters():
            p.mul_(1.5)
    params = SamplingParams(max_new_tokens=4, temperature=1.0, seed=5)
    split = decode.generate(PROMPTS, params, prefilled=prefill.prefill(PROMPTS, params))
    own = prefill.generate(PROMPTS, params)
    alone = decode.generate(PROMPTS, params)
    assert [g.logprobs[0] for g in split] == [g.logprobs[0] for g in own]
    assert [g.logprobs[0] for g in split] != [g.logprobs[0] for g in alone]
