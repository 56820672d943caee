"""Qwen3-VL (dense and MoE) and Qwen3.5 (dense and MoE; a hybrid Gated DeltaNet language model)
through the image path of Qwen2.5-VL (`tests/test_vlm.py`), on their tiny random configs: our mrope
positions and pixel values give the model's own forward, packed rows equal each sample alone, and
the transformers engine generates with images."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from rlcore.batch.packing import make_micro_batch
from rlcore.config import ModelConfig
from rlcore.models import vision
from rlcore.models.build import build_model, build_tokenizer
from rlcore.types import Sample
from tests.test_vlm import _reference_logprobs, prompt

FAMILIES = ["tiny_qwen3_vl", "tiny_qwen3_vl_moe", "tiny_qwen3_5", "tiny_qwen3_5_moe"]


@pytest.fixture(scope="module", params=FAMILIES)
def vl(request):
    cfg = OmegaConf.to_object(
        OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load(f"conf/model/{request.param}.yaml"))
    )
    tok = build_tokenizer(cfg)
    return cfg, tok, tok.rlcore_vision


def image(spec, seed: int, h: int = 2, w: int = 2) -> np.ndarray:
    """A processor-ready random image of h x w merge windows."""
    f = spec.factor
    return np.random.default_rng(seed).integers(0, 256, (h * f, w * f, 3), dtype=np.uint8)


def samples_with_images(tok, spec) -> list[Sample]:
    out = []
    for i, imgs in enumerate([[image(spec, 0)], [], [image(spec, 1, 2, 4), image(spec, 2)]]):
        p = prompt(tok, spec, "how many?", imgs)
        c = tok(f"{i + 2}<|im_end|>", add_special_tokens=False).input_ids
        out.append(
            Sample(
                prompt_ids=p,
                completion_ids=c,
                logprobs=[0.0] * len(c),
                versions=[0] * len(c),
                loss_mask=[1] * len(c),
                images=imgs,
            )
        )
    return out


def test_family_is_a_vision_model_with_our_tokens(vl):
    cfg, tok, spec = vl
    model = build_model(cfg, tok)
    assert vision.is_vision_model(model) and vision.is_vl_arch(cfg.arch)
    assert model.config.image_token_id == tok.convert_tokens_to_ids(vision.IMAGE_PAD) == spec.image_token_id
    assert spec.processor_class == "Qwen3VLProcessor" and spec.patch_size == 16
    ids = prompt(tok, spec, "n?", [image(spec, 0), image(spec, 1, 2, 4)])
    assert ids.count(spec.image_token_id) == 4 + 8


def test_packed_equals_unpacked_logprobs(vl):
    from rlcore.models.hybrid import restart_state_at_boundaries
    from rlcore.trainer.attention import use_varlen_attention
    from rlcore.trainer.forward import forward_logprobs
    from rlcore.trainer.logprobs import install_logprob_head

    cfg, tok, spec = vl
    ref_model = build_model(cfg, tok).eval()
    model = build_model(cfg, tok).eval()
    use_varlen_attention(model, None)
    restart_state_at_boundaries(model)  # (Qwen3.5's linear-attention layers; none in Qwen3-VL)
    install_logprob_head(model, 0)
    samples = samples_with_images(tok, spec)
    mb = make_micro_batch(samples, [1.0, -1.0, 0.5])
    with torch.no_grad():
        packed, _ = forward_logprobs(model, mb, 1.0, None, torch.device("cpu"), vision=spec)
    start = 0
    for s in samples:
        n = s.num_tokens
        torch.testing.assert_close(
            packed[start : start + n - 1], _reference_logprobs(ref_model, s, spec), atol=1e-4, rtol=1e-4
        )
        start += n


def test_hf_engine_generates_with_images(vl):
    from rlcore.engine.base import SamplingParams
    from rlcore.engine.hf_engine import HFEngine

    cfg, tok, spec = vl
    engine = HFEngine(build_model(cfg, tok), tok.pad_token_id, tok.eos_token_id, vision=spec)
    imgs = [[image(spec, 0)], [image(spec, 1, 2, 4)], []]  # ragged prompts: left padding
    prompts = [prompt(tok, spec, "n?", im) for im in imgs]
    gens = engine.generate(prompts, SamplingParams(max_new_tokens=5, temperature=1.0, seed=3), images=imgs)
    ref_model = build_model(cfg, tok).eval()
    for p, im, g in zip(prompts, imgs, gens):
        assert len(g.token_ids) == len(g.logprobs) > 0
        s = Sample(
            prompt_ids=p,
            completion_ids=g.token_ids,
            logprobs=g.logprobs,
            versions=g.versions,
            loss_mask=[1] * len(g.token_ids),
            images=im,
        )
        ref = _reference_logprobs(ref_model, s, spec, mask_image_tokens=True)[len(p) - 1 :]
        torch.testing.assert_close(torch.tensor(g.logprobs), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("vl", ["tiny_qwen3_vl_moe", "tiny_qwen3_5_moe"], indirect=True)
def test_image_forward_replays_the_engine_routing(vl):
    """Routing replay through the image path: the transformers engine records the experts of every
    token it ran (image placeholders included), and the trainer's image forward uses them: on
    shared weights they are its own top-k (agreement 1.0 over every replayed row, logprobs as
    when it routes itself); other experts change its logprobs, so the given routing is what ran."""
    import copy

    from rlcore.engine.base import SamplingParams
    from rlcore.engine.hf_engine import HFEngine
    from rlcore.models.hybrid import restart_state_at_boundaries
    from rlcore.trainer.attention import use_varlen_attention
    from rlcore.trainer.forward import forward_logprobs
    from rlcore.trainer.logprobs import install_logprob_head
    from rlcore.trainer.moe import apply_expert_parallel, router_metrics

    cfg, tok, spec = vl
    engine = HFEngine(
        build_model(cfg, tok), tok.pad_token_id, tok.eos_token_id, seed=1, vision=spec, routing_replay=True
    )
    policy = copy.deepcopy(engine.model).train()
    blocks = apply_expert_parallel(policy, None)
    use_varlen_attention(policy, None)
    restart_state_at_boundaries(policy)
    install_logprob_head(policy, 0)
    imgs = [[image(spec, 0)], [image(spec, 1, 2, 4), image(spec, 2)]]  # ragged prompts: left padding
    prompts = [prompt(tok, spec, "n?", im) for im in imgs]
    gens = engine.generate(prompts, SamplingParams(max_new_tokens=5, temperature=1.0, seed=3), images=imgs)
    layers, k = cfg.arch["text_config"]["num_hidden_layers"], cfg.arch["text_config"]["num_experts_per_tok"]
    samples = []
    for p, im, g in zip(prompts, imgs, gens):
        assert g.routed_experts.shape == (len(p) + len(g.token_ids) - 1, layers, k)
        samples.append(
            Sample(
                p,
                g.token_ids,
                g.logprobs,
                g.versions,
                [1] * len(g.token_ids),
                images=im,
                routed_experts=g.routed_experts,
            )
        )
    mb = make_micro_batch(samples, [1.0, -1.0])
    cpu = torch.device("cpu")
    lp_replay, _ = forward_logprobs(policy, mb, 1.0, None, cpu, vision=spec)
    replayed = sum(int(b.stat_replayed) for b in blocks)  # every engine row, in every MoE layer
    assert replayed == sum(len(s.routed_experts) for s in samples) * k * len(blocks)
    assert router_metrics(policy)["moe_replay_agreement"] == 1.0
    given = mb.routed_experts
    mb.routed_experts = None  # the trainer's own routing: the same experts and weights
    lp_self, _ = forward_logprobs(policy, mb, 1.0, None, cpu, vision=spec)
    torch.testing.assert_close(lp_replay, lp_self)
    num_experts = cfg.arch["text_config"]["num_experts"]
    mb.routed_experts = torch.where(given < 0, given, (given + 1) % num_experts)  # other experts everywhere
    lp_other, _ = forward_logprobs(policy, mb, 1.0, None, cpu, vision=spec)
    assert router_metrics(policy)["moe_replay_agreement"] < 1.0
    assert not torch.allclose(lp_other, lp_self, atol=1e-4)
