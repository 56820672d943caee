"""Vision-language names shared by environments, validation and the model code (torch-free)."""

from __future__ import annotations

VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"
VISION_TOKENS = [VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD]
IMAGE_PLACEHOLDER = VISION_START + IMAGE_PAD + VISION_END
"""What a message's text contains where an image goes (one per image, in order)."""

VL_MODEL_TYPES = ("qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")
"""Vision-language model types rlcore builds, trains and serves."""


def is_vl_arch(arch: dict) -> bool:
    return arch.get("model_type") in VL_MODEL_TYPES
