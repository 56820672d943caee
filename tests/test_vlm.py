"""Vision-language policies on CPU: image tokens, pixel values, packed mrope forward, freezing,
the transformers engine with images, the shape_count environment and config validation."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from rlcore.batch.packing import make_micro_batch
from rlcore.config import ModelConfig
from rlcore.models import vision
from rlcore.models.build import build_model, build_tokenizer
from rlcore.types import Sample


def tiny_vl(**over) -> ModelConfig:
    base = OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load("conf/model/tiny_vl.yaml"))
    return OmegaConf.to_object(OmegaConf.merge(base, over))


@pytest.fixture(scope="module")
def vl():
    cfg = tiny_vl()
    tok = build_tokenizer(cfg)
    return cfg, tok, tok.rlcore_vision


def image(seed: int, h: int = 56, w: int = 56) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def prompt(tok, spec, text: str, images: list) -> list[int]:
    ids = tok(vision.IMAGE_PLACEHOLDER * len(images) + text, add_special_tokens=False).input_ids
    return vision.expand_image_tokens(ids, images, spec)[0]


def test_tokens_and_config_agree(vl):
    cfg, tok, spec = vl
    model = build_model(cfg, tok)
    assert model.config.image_token_id == tok.convert_tokens_to_ids(vision.IMAGE_PAD) == spec.image_token_id
    assert model.config.vision_start_token_id == tok.convert_tokens_to_ids(vision.VISION_START)
    assert model.config.text_config.vocab_size == len(tok)
    # text ids are unchanged by the vision markers (a text-only tiny model keeps its weights)
    from rlcore.models.tokenizer import char_tokenizer

    assert char_tokenizer()("u:hi").input_ids == tok("u:hi").input_ids
    ids = prompt(tok, spec, "n?", [image(0), image(1, 56, 112)])
    assert ids.count(spec.image_token_id) == 4 + 8
    assert vision.collapse_image_tokens(ids, spec.image_token_id).count(spec.image_token_id) == 2


def test_pixel_values_match_transformers_processor(vl):
    _, _, spec = vl
    try:
        from transformers import AutoImageProcessor

        proc = AutoImageProcessor.from_pretrained(_saved(spec))
    except Exception as exc:  # noqa: BLE001 - needs torchvision or pillow (the GPU machine has them)
        pytest.skip(f"transformers image processor unavailable here: {exc}")
    imgs = [image(0), image(1, 84, 56)]
    ours, grid = vision.pixel_values(imgs, spec)
    ref = proc(images=imgs, return_tensors="pt")
    assert torch.equal(grid, ref["image_grid_thw"])
    torch.testing.assert_close(ours, ref["pixel_values"].float(), atol=1e-5, rtol=1e-5)


def _saved(spec) -> str:
    import tempfile

    d = tempfile.mkdtemp()
    spec.save(d)
    return d


def test_mrope_positions_layout(vl):
    _, tok, spec = vl
    ids = [5, 6] + [spec.image_token_id] * 8 + [7, 8]  # one 56x112 image: merged grid 2 x 4
    pos = vision.mrope_positions(ids, [(1, 4, 8)], spec)
    assert pos[:, :2].tolist() == [[0, 1]] * 3
    assert pos[0, 2:10].tolist() == [2] * 8
    assert pos[1, 2:10].tolist() == [2, 2, 2, 2, 3, 3, 3, 3]
    assert pos[2, 2:10].tolist() == [2, 3, 4, 5] * 2
    assert pos[:, 10:].tolist() == [[6, 7]] * 3


def own_image_inputs(model, ids: torch.Tensor, images: list, spec) -> dict:
    """The keyword arguments of a vision model's own forward for `images` of the row `ids`
    ([1, T]): pixel values, grids and (where the model takes them) the token types; {} without."""
    if not images:
        return {}
    pixels, grids = vision.pixel_values(images, spec)
    kwargs = dict(pixel_values=pixels, image_grid_thw=grids)
    if "mm_token_type_ids" in inspect.signature(model.model.forward).parameters:
        kwargs["mm_token_type_ids"] = (ids == spec.image_token_id).int()
    return kwargs


def _reference_logprobs(model, sample: Sample, spec, mask_image_tokens: bool = False) -> torch.Tensor:
    """The model's own forward (its own mrope positions, sdpa) on one unpacked sample."""
    ids = torch.tensor([sample.prompt_ids + sample.completion_ids])
    kwargs = own_image_inputs(model, ids, sample.images, spec)
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False, **kwargs).logits[0]
    logp = torch.log_softmax(logits.float(), -1)
    if mask_image_tokens:  # what the engines sample from: image/video pad tokens removed
        logp[:, [spec.image_token_id, spec.image_token_id + 1]] = float("-inf")
        logp = torch.log_softmax(logp, -1)
    return logp[:-1].gather(-1, ids[0, 1:, None]).squeeze(-1)


def test_packed_equals_unpacked_logprobs(vl):
    from rlcore.trainer.attention import use_varlen_attention
    from rlcore.trainer.forward import forward_logprobs
    from rlcore.trainer.logprobs import install_logprob_head

    cfg, tok, spec = vl
    ref_model = build_model(cfg, tok).eval()
    model = build_model(cfg, tok).eval()
    use_varlen_attention(model, None)
    install_logprob_head(model, 0)
    samples = []
    for i, imgs in enumerate([[image(0)], [], [image(1, 56, 112), image(2)]]):
        p = prompt(tok, spec, "how many?", imgs)
        c = tok(f"{i + 2}<|im_end|>", add_special_tokens=False).input_ids
        samples.append(
            Sample(
                prompt_ids=p,
                completion_ids=c,
                logprobs=[0.0] * len(c),
                versions=[0] * len(c),
                loss_mask=[1] * len(c),
                images=imgs,
            )
        )
    mb = make_micro_batch(samples, [1.0, -1.0, 0.5])
    assert len(mb.images) == 3
    with torch.no_grad():
        packed, _ = forward_logprobs(model, mb, 1.0, None, torch.device("cpu"), vision=spec)
    start = 0
    for s in samples:
        n = s.num_tokens
        torch.testing.assert_close(
            packed[start : start + n - 1], _reference_logprobs(ref_model, s, spec), atol=1e-4, rtol=1e-4
        )
        start += n


def test_freeze_vision_trains_language_model_only(tmp_path):
    import os

    from rlcore.config import RunConfig
    from rlcore.trainer.core import TrainerCore, free_port

    cfg = OmegaConf.to_object(
        OmegaConf.merge(
            OmegaConf.structured(RunConfig),
            {
                "model": OmegaConf.to_container(OmegaConf.structured(tiny_vl(freeze_vision=True))),
                "steps": 1,
                "trainer": {"lr": 1e-2},
            },
        )
    )
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(free_port())
    core = TrainerCore(cfg, 0, 1)
    try:
        spec = core.vision
        before = {n: p.detach().clone() for n, p in core.full_parameters()}
        imgs = [image(3)]
        p = prompt(core.tokenizer, spec, "n?", imgs)
        s = Sample(
            prompt_ids=p, completion_ids=[40, 2], logprobs=[-1.0, -1.0], versions=[0, 0], loss_mask=[1, 1], images=imgs
        )
        core.sft_step([make_micro_batch([s], [0.0])], 2)
        after = dict(core.full_parameters())
        changed = {n for n in before if not torch.equal(before[n], after[n])}
        assert changed and not any(n.startswith("model.visual.") for n in changed)
        assert any(n.startswith("model.language_model.") for n in changed)
        assert not any(p.requires_grad for n, p in core.model.named_parameters() if "visual" in n)
    finally:
        core.shutdown()


def test_hf_engine_generates_with_images(vl):
    from rlcore.engine.base import SamplingParams
    from rlcore.engine.hf_engine import HFEngine

    cfg, tok, spec = vl
    engine = HFEngine(build_model(cfg, tok), tok.pad_token_id, tok.eos_token_id, vision=spec)
    imgs = [[image(0)], [image(1, 56, 112)], []]
    prompts = [prompt(tok, spec, "n?", im) for im in imgs]
    gens = engine.generate(prompts, SamplingParams(max_new_tokens=5, temperature=1.0, seed=3), images=imgs)
    assert all(len(g.token_ids) == len(g.logprobs) for g in gens)
    # the sampled logprobs are the trainer's: score each completion with the reference forward
    ref_model = build_model(cfg, tok).eval()
    for p, im, g in zip(prompts, imgs, gens):
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


def test_shape_count_env():
    from rlcore.envs import make_env

    env = make_env("shape_count", {"image_size": 56, "max_shapes": 4}, seed=0)
    task = env.make_task(3, "train")
    assert task.images and task.images[0].shape == (56, 56, 3) and task.images[0].dtype == np.uint8
    assert vision.IMAGE_PLACEHOLDER in task.messages[0]["content"]
    assert env.reward(task, task.answer) == 1.0
    assert env.reward(task, f" {task.answer} ") == 1.0
    assert env.reward(task, str(int(task.answer) + 1)) == 0.0
    assert env.make_task(3, "train").answer == task.answer  # deterministic
    assert env.demonstration(task) == task.answer
    assert env.eval_tasks()[0].id.startswith("shape_count/eval/")


def test_validation_messages():
    from rlcore.plan.compose import compose
    from rlcore.plan.validate import problems

    keys = dict(problems(compose(["+recipe=shape_count", "model=tiny_char"])))
    assert "images" in keys.get("env.name", "")
    keys = dict(problems(compose(["+recipe=shape_count", "trainer.cp=2", "trainer.world_size=2"])))
    assert "trainer.cp" in keys
    keys = dict(problems(compose(["model.freeze_vision=true"])))
    assert "model.freeze_vision" in keys
    assert problems(compose(["+recipe=shape_count"])) == []


def test_vllm_engine_from_config_writes_a_processor_ready_model_dir(monkeypatch, tmp_path):
    """vLLM's multimodal processor loads the tokenizer and preprocessor configs from the model
    dir; a text model's dir holds config.json alone."""
    import os

    from rlcore.engine.vllm.vllm_engine import VLLMEngine
    from rlcore.plan.compose import compose

    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    seen = {}
    monkeypatch.setattr(VLLMEngine, "__init__", lambda self, path, **kw: seen.update(kw, path=path))
    cfg = compose(["+recipe=shape_count", "rollout.engine=vllm"])
    VLLMEngine.from_config(cfg.rollout.vllm, cfg.model)
    files = set(os.listdir(seen["path"]))
    assert {"config.json", "tokenizer.json", "preprocessor_config.json"} <= files
    assert seen["skip_tokenizer_init"] is False and seen["vision"] is not None and seen["load_format"] == "dummy"
    seen.clear()
    cfg = compose(["rollout.engine=vllm"])
    VLLMEngine.from_config(cfg.rollout.vllm, cfg.model)
    assert os.listdir(seen["path"]) == ["config.json"] and "vision" not in seen
