"""A vLLM engine's model and arguments from its config section and the model config, including
the model directory of a random-weight model (vLLM loads models from a directory or hub id only)."""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from typing import Any

from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
)

from rlcore.engine.vllm.vllm_cache import model_dir
from rlcore.models.tokenizer_build import build_tokenizer, random_model_config


def engine_args(v: Any, model: Any, seed: int = 0, tokenizer: Any = None) -> tuple[str, dict[str, Any]]:
    """(model, keyword arguments) of :class:`rlcore.engine.vllm.vllm_engine.VLLMEngine` for its
    section ``v`` (``rollout.vllm``: a ``VLLMOptions``) and ``model`` (a ``ModelConfig``). A
    random-weight model (``model.path`` null) is written as a directory holding its
    ``config.json`` (plus tokenizer and image processor for a vision-language model), at a path
    named by its content under the per-user cache (`rlcore.engine.vllm.vllm_cache.model_dir`),
    and started with dummy weights: the first sync fills them."""
    quantization = v.quantization
    reload = v.weight_reload
    if reload == "auto":  # the fast direct receive unless weights are processed after loading
        reload = "layerwise" if quantization else "direct"
    kwargs: dict[str, Any] = dict(
        tensor_parallel_size=v.tensor_parallel_size, seed=seed, reload=reload, kv_on_update=v.kv_on_update
    )
    if quantization is not None:
        kwargs["quantization"] = quantization
    if v.sleep_level:
        kwargs["enable_sleep_mode"] = True
    if v.routing_replay:  # each request's final output carries its routed experts (rlcore.batch.routing)
        kwargs["enable_return_routed_experts"] = True
    if v.sampling_kwargs:
        kwargs["extra_sampling"] = dict(v.sampling_kwargs)
    if v.kv_offload_gb > 0:  # vLLM's native CPU offload of evicted KV blocks (its OffloadingConnector)
        kwargs.update(kv_offloading_size=float(v.kv_offload_gb), kv_offloading_backend="native")
    if _gated_deltanet(model) and importlib.util.find_spec("flashinfer") is None:
        # vLLM picks FlashInfer's Gated DeltaNet prefill on sm90 and dies importing it where the
        # package is absent (`No module named 'flashinfer'`); its Triton kernel needs nothing
        kwargs["gdn_prefill_backend"] = "triton"
    kwargs.update(v.engine_kwargs)
    path = model.path
    if path is None:
        model_type = model.arch.get("model_type")
        tokenizer = tokenizer if tokenizer is not None else build_tokenizer(model)
        vision = tokenizer.rlcore_vision
        if vision is not None:
            names, kind = MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES, "an image-text-to-text"
        else:
            names, kind = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, "a causal-LM"
        if model_type not in names:
            raise ValueError(f"model.arch.model_type: vLLM needs {kind} model_type, got {model_type!r}")
        # the same config the trainer builds (vocabulary sized to the tokenizer)
        hf_config = random_model_config(model, tokenizer)
        hf_config.architectures = [names[model_type]]  # vLLM picks its class by this
        kwargs["load_format"] = "dummy"

        def write(where: str) -> None:
            hf_config.save_pretrained(where)
            if vision is not None:
                # vLLM's multimodal processor needs the tokenizer (placeholder ids) and the image
                # processor config next to config.json
                tokenizer.save_pretrained(where)
                vision.save(where)

        # named by its content: the next run's engine has the same path, so vLLM's compile cache
        # (whose key holds the model path) finds this run's graphs (`vllm_cache`)
        path = model_dir(write)
        if vision is not None:
            kwargs.update(skip_tokenizer_init=False, vision=vision)  # a tokenizer-enabled engine
    return path, kwargs


def _gated_deltanet(model: Any) -> bool:
    """Whether the model has Gated DeltaNet layers (Qwen3-Next, Qwen3.5): their config names the
    linear-attention key head size. A model on disk is read from its ``config.json``."""
    arch = dict(model.arch or {})
    if model.path is not None and not arch:
        try:
            from transformers import AutoConfig

            hf = AutoConfig.from_pretrained(model.path)
            arch = (getattr(hf, "text_config", None) or hf).to_dict()
        except (OSError, ValueError):
            return False
    text = arch.get("text_config")
    return "linear_key_head_dim" in (text if isinstance(text, Mapping) else arch)
