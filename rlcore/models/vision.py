"""Images for Qwen-VL-family policies (Qwen2.5-VL layout), the torch half: pixel values and
mrope position ids. The image contract (processor-ready uint8 arrays, one expanded
``<|image_pad|>`` run per image) is stated in :mod:`rlcore.models.images`.

The torch-free half (processor settings, image checks, token expansion) is
:mod:`rlcore.models.images`, re-exported here.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from rlcore.models.images import (  # noqa: F401  (re-exported)
    CLIP_MEAN,
    CLIP_STD,
    VisionSpec,
    check_image,
    collapse_image_tokens,
    expand_image_tokens,
    fit_image,
    grid_thw,
    image_runs,
    num_image_tokens,
    spec_from_config,
    to_array,
)
from rlcore.models.vl_names import (  # noqa: F401  (re-exported)
    IMAGE_PAD,
    IMAGE_PLACEHOLDER,
    VIDEO_PAD,
    VISION_END,
    VISION_START,
    VISION_TOKENS,
    VL_MODEL_TYPES,
    is_vl_arch,
)


def is_vision_model(model_or_config: Any) -> bool:
    config = getattr(model_or_config, "config", model_or_config)
    return getattr(config, "vision_config", None) is not None


def text_config(config: Any) -> Any:
    """The language model's config (the config itself for a text-only model)."""
    return getattr(config, "text_config", None) or config


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder layers of a causal LM or a VLM's language model (``model.model.language_model``)."""
    inner = model.model
    return getattr(inner, "language_model", inner).layers


def vision_tower(model: torch.nn.Module) -> torch.nn.Module | None:
    return getattr(getattr(model, "model", None), "visual", None)


def pixel_values(images: Sequence[np.ndarray], spec: VisionSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """(``pixel_values`` float32 ``[sum patches, 3 * T * P * P]``, ``image_grid_thw`` ``[n, 3]``),
    in the Qwen2-VL image processor's patch order: a still image is repeated ``T`` times,
    rescaled to [0, 1], normalised, and cut into merge-window-major patches."""
    P, T, m = spec.patch_size, spec.temporal_patch_size, spec.merge_size
    mean = np.asarray(spec.image_mean, dtype=np.float32)[:, None, None]
    std = np.asarray(spec.image_std, dtype=np.float32)[:, None, None]
    patches, grids = [], []
    for arr in images:
        _, gh, gw = grid_thw(arr, spec)
        x = (arr.astype(np.float32).transpose(2, 0, 1) * np.float32(1 / 255) - mean) / std  # [C, H, W]
        x = np.broadcast_to(x[None], (T, *x.shape))  # [T, C, H, W]
        C = x.shape[1]
        x = x.reshape(1, T, C, gh // m, m, P, gw // m, m, P)
        x = x.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)  # grid_t, h/m, w/m, m, m, C, T, P, P
        patches.append(x.reshape(gh * gw, C * T * P * P))
        grids.append((1, gh, gw))
    if not patches:
        return torch.zeros(0, 3 * T * P * P), torch.zeros(0, 3, dtype=torch.long)
    return torch.from_numpy(np.concatenate(patches)), torch.tensor(grids, dtype=torch.long)


def mrope_positions(ids: Sequence[int], grids: Sequence[Sequence[int]], spec: VisionSpec) -> torch.Tensor:
    """Qwen2-VL's 3-D (temporal, height, width) rope positions ``[3, L]`` of one sample: text
    tokens count on in all three rows; an image's tokens take ``start + (0, row, col)`` over its
    merged grid, and the text after it resumes at ``max + 1``. (Still images: temporal index 0.)"""
    runs = image_runs(ids, spec.image_token_id)
    if len(runs) != len(grids):
        raise ValueError(f"sample has {len(runs)} image token run(s) but {len(grids)} image grid(s)")
    pos = torch.empty(3, len(ids), dtype=torch.long)
    cursor, nxt = 0, 0
    for (start, length), (t, h, w) in zip(runs, grids):
        gh, gw = h // spec.merge_size, w // spec.merge_size
        if length != t * gh * gw:
            raise ValueError(f"image token run of {length} does not match grid {t}x{h}x{w}")
        text = torch.arange(start - cursor) + nxt
        pos[:, cursor:start] = text
        nxt += start - cursor
        tt = torch.arange(t).repeat_interleave(gh * gw)
        hh = torch.arange(gh).repeat_interleave(gw).repeat(t)
        ww = torch.arange(gw).repeat(t * gh)
        pos[:, start : start + length] = torch.stack([tt, hh, ww]) + nxt
        nxt = int(pos[:, start : start + length].max()) + 1
        cursor = start + length
    pos[:, cursor:] = torch.arange(len(ids) - cursor) + nxt
    return pos


def packed_mrope_positions(
    input_ids: torch.Tensor, sample_index: torch.Tensor, grids: torch.Tensor, spec: VisionSpec
) -> torch.Tensor:
    """`mrope_positions` of every sample of a packed row, concatenated: ``[3, T]``. The images'
    grids are in sample order (how `rlcore.batch.packing` concatenates them)."""
    ids = input_ids.tolist()
    bounds = torch.nonzero(torch.diff(sample_index, prepend=sample_index[:1] - 1)).flatten().tolist() + [len(ids)]
    out, g = [], 0
    for a, b in zip(bounds[:-1], bounds[1:]):
        k = len(image_runs(ids[a:b], spec.image_token_id))
        out.append(mrope_positions(ids[a:b], grids[g : g + k].tolist(), spec))
        g += k
    return torch.cat(out, dim=1)
