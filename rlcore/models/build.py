"""Build the policy model and tokenizer from a ModelConfig, identically in every process."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerBase

from rlcore.config import ModelConfig
from rlcore.models import vision
from rlcore.models.tokenizer_build import build_tokenizer, random_model_config, vision_spec  # noqa: F401 (re-exported)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    return _DTYPES[name]


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
