"""Build the policy model and tokenizer from a ModelConfig, identically in every process."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from rlcore.config import ModelConfig
from rlcore.models.tokenizer import char_tokenizer

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    return _DTYPES[name]


def build_tokenizer(cfg: ModelConfig) -> PreTrainedTokenizerBase:
    if cfg.tokenizer == "char":
        return char_tokenizer()
    kwargs = {"gguf_file": cfg.gguf_file} if cfg.gguf_file else {}
    return AutoTokenizer.from_pretrained(cfg.path, **kwargs)


def random_model_config(cfg: ModelConfig, tokenizer: PreTrainedTokenizerBase):
    """The transformers config of the random-weight model `cfg.arch` describes, sized to the
    tokenizer (every process and engine builds the same one)."""
    arch = dict(cfg.arch)
    model_type = arch.pop("model_type")
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
        return AutoModelForCausalLM.from_pretrained(cfg.path, dtype=dtype, **kwargs)
    hf_config = random_model_config(cfg, tokenizer)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    return model
