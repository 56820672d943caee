"""VLLMEngine with a vision-language model on one GPU: a small random-weight Qwen2.5-VL-shaped
policy (character vocabulary), image prompts, weights loaded from a trainer-built model, canary.

    PYTHONPATH=$PWD:$PYTHONPATH python -m pytest -m gpu tests/gpu/test_vllm_vlm.py -v
"""

from __future__ import annotations

import importlib.util

import pytest

pytestmark = [
    pytest.mark.gpu(gpus=1),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm"),
]

OVERRIDES = [
    "+recipe=shape_count",
    "rollout.engine=vllm",
    "rollout.gpus_per_actor=1",
    "model.arch.text_config.hidden_size=512",
    "model.arch.text_config.intermediate_size=1024",
    "model.arch.text_config.num_hidden_layers=4",
    "model.arch.text_config.num_attention_heads=8",
    "model.arch.text_config.num_key_value_heads=4",
    "model.arch.text_config.rope_scaling.mrope_section=[8,12,12]",
    "model.arch.vision_config.out_hidden_size=512",
    "model.arch.vision_config.hidden_size=256",
    "model.arch.vision_config.num_heads=4",
]


def test_vllm_vlm_image_prompt_sync_and_canary():
    import torch

    from rlcore.engine.base import SamplingParams
    from rlcore.engine.hf_engine import HFEngine
    from rlcore.engine.vllm.vllm_engine import VLLMEngine
    from rlcore.envs import build_env
    from rlcore.envs.base import task_images
    from rlcore.models.build import build_model, build_tokenizer
    from rlcore.models.vision import expand_image_tokens
    from rlcore.plan.compose import compose

    cfg = compose(OVERRIDES)
    tok = build_tokenizer(cfg.model)
    spec = tok.rlcore_vision
    trainer_model = build_model(cfg.model, tok)
    with torch.no_grad():  # move off the initial weights so a missed sync shows
        for p in trainer_model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    engine = VLLMEngine.from_config(
        cfg.rollout.vllm,
        cfg.model,
        seed=0,
        enforce_eager=True,
        gpu_memory_utilization=0.3,
        max_model_len=512,
        rpc_timeout_s=300,
        startup_timeout_s=900,
    )
    try:
        # trainer names (model.visual.*, model.language_model.*) through vLLM's hf_to_vllm_mapper
        engine.apply_weights(list(trainer_model.named_parameters()), 1)
        env = build_env(cfg.env)
        tasks = [env.make_task(i, "train") for i in range(4)]
        images = [task_images(t, tok) for t in tasks]
        prompts = [expand_image_tokens(env.render(t, tok), im, spec)[0] for t, im in zip(tasks, images)]
        gens = engine.generate(prompts, SamplingParams(max_new_tokens=8, temperature=1.0, seed=1), images=images)
        assert all(len(g.token_ids) == len(g.logprobs) > 0 and set(g.versions) == {1} for g in gens)
        assert not any(spec.image_token_id in g.token_ids for g in gens)
        # image-conditioned canary: the engine's sampled logprobs against the transformers engine
        # scoring the same tokens with the same weights (fp32 on GPU vs vLLM bf16: loose bound)
        ref = HFEngine(trainer_model, tok.pad_token_id, tok.eos_token_id, device="cuda", vision=spec)
        gaps = []
        for p, im, g in zip(prompts, images, gens):
            logits_lp = _score(ref, p, im, g.token_ids, spec)
            gaps += [abs(a - b) for a, b in zip(logits_lp, g.logprobs)]
        assert max(gaps) < 0.5 and sum(gaps) / len(gaps) < 0.1, (max(gaps), sum(gaps) / len(gaps))
        # the text canary the driver runs after every sync
        from rlcore.weights.canary import canary_prompts

        pairs = canary_prompts(len(tok), num_prompts=2, prompt_len=16, completion_len=16)
        got = engine.score_batch(pairs)
        for (p, c), lp in zip(pairs, got):
            want = ref.score(list(p), list(c))
            assert max(abs(a - b) for a, b in zip(lp, want)) < 0.5
    finally:
        engine.shutdown()


def _score(ref, prompt, images, completion, spec):
    import torch

    from rlcore.models.vision import mrope_positions, pixel_values

    pixels, grids = pixel_values(images, spec)
    ids = prompt + completion
    pos = mrope_positions(ids, grids.tolist(), spec)[:, None, :].cuda()
    with torch.no_grad():
        logits = (
            ref.model(
                input_ids=torch.tensor([ids]).cuda(),
                position_ids=pos,
                pixel_values=pixels.cuda(),
                image_grid_thw=grids.cuda(),
                use_cache=False,
            )
            .logits[0]
            .float()
        )
    lp = torch.log_softmax(logits, -1)
    # engine logprobs are of the tempered distribution with image tokens masked: renormalise
    lp[:, [spec.image_token_id, spec.image_token_id + 1]] = float("-inf")
    lp = torch.log_softmax(lp, -1)
    tgt = torch.tensor(ids[1:]).cuda()
    return lp[:-1].gather(-1, tgt[:, None]).squeeze(-1)[len(prompt) - 1 :].tolist()
