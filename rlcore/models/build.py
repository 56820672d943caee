"""Build the policy model and tokenizer from a ModelConfig, identically in every process."""

from __future__ import annotations

import functools

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from rlcore.config import ModelConfig
from rlcore.models import vision
from rlcore.models.tokenizer import bpe_tokenizer, char_tokenizer

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    return _DTYPES[name]


def build_tokenizer(cfg: ModelConfig) -> PreTrainedTokenizerBase:
    """The tokenizer; for a vision-language model it carries the model's `VisionSpec` as
    ``tokenizer.rlcore_vision`` (environments expand image tokens with it), else None there."""
    if cfg.tokenizer == "char":
        tok = char_tokenizer(vision=vision.is_vl_arch(cfg.arch))
    elif cfg.tokenizer == "bpe":
        tok = bpe_tokenizer()
    else:
        kwargs = {"gguf_file": cfg.gguf_file} if cfg.gguf_file else {}
        tok = AutoTokenizer.from_pretrained(cfg.path, **kwargs)
    if cfg.chat_template_kwargs:
        # every rendering (prompts, env turns, SFT, the OpenAI server) goes through this method:
        # binding the variables here keeps them identical across all of them
        tok.apply_chat_template = functools.partial(tok.apply_chat_template, **cfg.chat_template_kwargs)
    tok.rlcore_vision = vision_spec(cfg, tok)
    return tok


def vision_spec(cfg: ModelConfig, tokenizer: PreTrainedTokenizerBase) -> vision.VisionSpec | None:
    """How images become inputs of this model (None for a text-only model): from `arch` and
    `processor` for a random-weight VLM, from the checkpoint's config and preprocessor_config.json
    (overridden by `processor`) for `path`."""
    if cfg.path is None:
        if not vision.is_vl_arch(cfg.arch):
            return None
        return vision.spec_from_config(random_model_config(cfg, tokenizer), dict(cfg.processor))
    if cfg.gguf_file:  # GGUF checkpoints are text-only here
        return None
    try:
        hf_config = AutoConfig.from_pretrained(cfg.path)
    except (OSError, ValueError):  # not a transformers directory: the model build reports it
        return None
    if not vision.is_vision_model(hf_config):
        return None
    import json

    from transformers.utils import cached_file
    found = cached_file(cfg.path, "preprocessor_config.json", _raise_exceptions_for_missing_entries=False)
    processor = json.loads(open(found).read()) if found else {}
    processor.update(cfg.processor)
    return vision.spec_from_config(hf_config, processor)


def random_model_config(cfg: ModelConfig, tokenizer: PreTrainedTokenizerBase):
    """The transformers config of the random-weight model `cfg.arch` describes, sized to the
    tokenizer (every process and engine builds the same one)."""
    arch = dict(cfg.arch)
    model_type = arch.pop("model_type")
    if model_type in vision.VL_MODEL_TYPES:
        # the language model's fields live in text_config; the vision markers are the
        # tokenizer's own ids (vLLM and the model find images by them)
        ids = dict(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                   bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
        marks = {k: tokenizer.convert_tokens_to_ids(t) for k, t in (
            ("image_token_id", vision.IMAGE_PAD), ("video_token_id", vision.VIDEO_PAD),
            ("vision_start_token_id", vision.VISION_START), ("vision_end_token_id", vision.VISION_END))}
        text = {**dict(arch.pop("text_config", {})), **ids}
        return AutoConfig.for_model(model_type, text_config=text, vision_config=dict(arch.pop("vision_config", {})),
                                    **marks, **{k: v for k, v in ids.items() if k != "vocab_size"}, **arch)
    return AutoConfig.for_model(
        model_type,
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **arch,
    )


def build_model(cfg: ModelConfig, tokenizer: PreTrainedTokenizerBase) -> torch.nn.Module:
    """A pretrained model from `cfg.path`, or a random-weight one from `cfg.arch` seeded with
    `cfg.seed` (so every process that builds it holds the same initial weights)."""
    dtype = torch_dtype(cfg.dtype)
    if cfg.path:
        kwargs = {"gguf_file": cfg.gguf_file} if cfg.gguf_file else {}
        if not cfg.gguf_file and vision.is_vision_model(AutoConfig.from_pretrained(cfg.path)):
            from transformers import AutoModelForImageTextToText
            return AutoModelForImageTextToText.from_pretrained(cfg.path, dtype=dtype, **kwargs)
        return AutoModelForCausalLM.from_pretrained(cfg.path, dtype=dtype, **kwargs)
    hf_config = random_model_config(cfg, tokenizer)
    auto = AutoModelForCausalLM
    if vision.is_vision_model(hf_config):
        from transformers import AutoModelForImageTextToText as auto
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        model = auto.from_config(hf_config, dtype=dtype)
    return model
