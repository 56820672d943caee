"""Per-sequence attention masks of a packed row for families whose transformers model does not
derive them from the position ids itself.

transformers finds the sequences of a packed row (position ids restarting at 0) while it builds
its masks, but only where a model hands its position ids to the mask builders; gpt-oss's model
(transformers 5.x) does not, so its packed rows attended across sequence boundaries (a sample's
logprobs depended on the samples packed before it). For such a family the trainer builds the
masks itself, with transformers' own builders and the position ids, and passes the mapping
(layer type -> mask) the model accepts as ``attention_mask``.
"""

from __future__ import annotations

import inspect

import torch

from rlcore.models.vision import text_config

NEEDS_PACKED_MASKS = ("gpt_oss",)
"""Model types whose forward does not pass position ids to transformers' mask builders."""


def packed_mask_kwargs(model: torch.nn.Module, position_ids: torch.Tensor, dtype: torch.dtype) -> dict:
    """``{"attention_mask": {layer type: mask}}`` for `model`'s packed row [1, T] of `position_ids`
    (on the model's device), or {} when the model derives them itself."""
    config = text_config(model.config)
    if getattr(config, "model_type", None) not in NEEDS_PACKED_MASKS:
        return {}
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    shape_of = torch.empty((1, position_ids.shape[-1], 1), dtype=dtype, device=position_ids.device)
    # the cache argument was `past_key_values` before transformers 5.2x renamed it `cache` (the GPU
    # machine's 5.17 refused `cache`): passed by whichever name this version takes
    cache_kw = "cache" if "cache" in inspect.signature(create_causal_mask).parameters else "past_key_values"
    kw = dict(config=config, inputs_embeds=shape_of, attention_mask=None, position_ids=position_ids, **{cache_kw: None})
    return {
        "attention_mask": {
            "full_attention": create_causal_mask(**kw),
            "sliding_attention": create_sliding_window_causal_mask(**kw),
        }
    }
