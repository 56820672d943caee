"""The non-weight files of a Hugging Face model directory: config.json, generation config and
tokenizer. Checkpoints (`rlcore.storage.checkpoint`, their `hf/` folder) and exports (`rlcore.export`)
write them the same way."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def _base_class(model: torch.nn.Module) -> type:
    """The transformers class under FSDP2's dynamic wrapper class (`FSDPQwen3ForCausalLM`)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return type(model)
    return next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))


def save_config_and_tokenizer(model: torch.nn.Module, tokenizer, out_dir: Path, dtype: str) -> None:
    """config.json (with `architectures` and `dtype` set, which vLLM needs), generation config and
    tokenizer files of `model` into `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    config = model.config
    config.architectures = [_base_class(model).__name__]
    config.dtype = dtype
    config.save_pretrained(out_dir)
    drop_gguf_quantization(out_dir / "config.json")
    gen = getattr(model, "generation_config", None)
    if gen is not None:
        try:
            gen.save_pretrained(out_dir)
        except ValueError:  # an inconsistent generation config is not worth failing an export
            pass
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)


def drop_gguf_quantization(config_json: Path) -> None:
    """A model started from a GGUF file was dequantized at load: its weights are plain, so the
    `quantization_config: {quant_method: gguf}` transformers leaves in its config would make the
    exported directory claim a quantization it does not have (and fail to save again)."""
    config = json.loads(config_json.read_text())
    quant = config.get("quantization_config")
    if isinstance(quant, dict) and quant.get("quant_method") == "gguf":
        del config["quantization_config"]
        config_json.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
