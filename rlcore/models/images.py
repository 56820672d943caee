"""Images for Qwen-VL-family policies, torch-free: the processor settings (`VisionSpec`), image
checks and resizing, and the image tokens of a prompt. Environments and validation use these
before torch loads; the tensors (pixel values, mrope positions) are in :mod:`rlcore.models.vision`.

Contract. Images travel as uint8 ``[H, W, 3]`` arrays (compact through Ray) and arrive
*processor-ready*: height and width are multiples of ``patch_size * merge_size`` (28) and the
pixel count lies in ``[min_pixels, max_pixels]``. Then the Qwen2-VL image processor does no
resizing, and the trainer and the transformers engine (`rlcore.models.vision`) and vLLM (the
transformers processor inside vLLM) all see exactly the same pixels; an image that is not
processor-ready is rejected, never silently resized differently in different processes.
`fit_image` resizes one for environments that load arbitrary pictures.

Tokens. A prompt carries one ``<|image_pad|>`` per image (between ``<|vision_start|>`` and
``<|vision_end|>``); `expand_image_tokens` replaces it by the ``t * h * w / merge**2`` copies the
model consumes, once, when the prompt is rendered: samples store the expanded ids, so the
trainer scores exactly the tokens the engine saw. Position ids are Qwen2-VL's 3-D mrope ones
(`mrope_positions`), computed per sample.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from rlcore.models.vl_names import IMAGE_PAD, IMAGE_PLACEHOLDER

# CLIP normalisation: what Qwen2-VL/2.5-VL ship in their preprocessor_config.json
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]


@dataclass
class VisionSpec:
    """What turns images into model inputs: the image processor's settings and the model's
    image token."""

    image_token_id: int
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    image_mean: list[float] = field(default_factory=lambda: list(CLIP_MEAN))
    image_std: list[float] = field(default_factory=lambda: list(CLIP_STD))
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 256
    processor_class: str = "Qwen2_5_VLProcessor"
    """The transformers processor vLLM builds for the model (`PROCESSOR_CLASSES`)."""

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    def preprocessor_config(self) -> dict[str, Any]:
        """``preprocessor_config.json`` of a model directory (the layout Qwen2.5-VL checkpoints
        ship; every transformers 5.x resolves these class names)."""
        d = asdict(self)
        d.pop("image_token_id")
        d.update(
            image_processor_type="Qwen2VLImageProcessor",
            do_resize=True,
            do_rescale=True,
            rescale_factor=1 / 255,
            do_normalize=True,
            do_convert_rgb=True,
        )
        return d

    def save(self, directory: str | Path) -> None:
        """preprocessor_config.json, and the same settings as video_preprocessor_config.json: the
        Qwen2.5-VL processor vLLM loads wants a video processor too (images only are sent)."""
        Path(directory, "preprocessor_config.json").write_text(json.dumps(self.preprocessor_config(), indent=2))
        video_type = (
            "Qwen2VLVideoProcessor" if self.processor_class == "Qwen2_5_VLProcessor" else "Qwen3VLVideoProcessor"
        )
        video = {**self.preprocessor_config(), "video_processor_type": video_type}
        video.pop("image_processor_type")
        Path(directory, "video_preprocessor_config.json").write_text(json.dumps(video, indent=2))


PROCESSOR_CLASSES = {
    "qwen2_5_vl": "Qwen2_5_VLProcessor",
    "qwen3_vl": "Qwen3VLProcessor",
    "qwen3_vl_moe": "Qwen3VLProcessor",
    "qwen3_5": "Qwen3VLProcessor",
    "qwen3_5_moe": "Qwen3VLProcessor",
}
"""model_type -> the processor its checkpoints name (Qwen3-VL and Qwen3.5 share Qwen3-VL's)."""


def spec_from_config(hf_config: Any, processor: dict | None = None) -> VisionSpec:
    """A VisionSpec from a VLM's transformers config plus image-processor fields (``processor``:
    a preprocessor_config.json dict or `model.processor` overrides)."""
    v = hf_config.vision_config
    kwargs = dict(
        image_token_id=int(hf_config.image_token_id),
        patch_size=int(v.patch_size),
        temporal_patch_size=int(v.temporal_patch_size),
        merge_size=int(v.spatial_merge_size),
        processor_class=PROCESSOR_CLASSES.get(getattr(hf_config, "model_type", None), "Qwen2_5_VLProcessor"),
    )
    for k in ("image_mean", "image_std", "min_pixels", "max_pixels"):
        if processor and processor.get(k) is not None:
            kwargs[k] = processor[k]
    if processor and isinstance(processor.get("size"), dict):  # newer layout: size.{shortest,longest}_edge
        size = processor["size"]
        kwargs.setdefault("min_pixels", size.get("shortest_edge", VisionSpec.min_pixels))
        kwargs.setdefault("max_pixels", size.get("longest_edge", VisionSpec.max_pixels))
    return VisionSpec(**kwargs)


# -- images ------------------------------------------------------------------------------------
def to_array(image: Any) -> np.ndarray:
    """uint8 ``[H, W, 3]`` from an array (HWC, uint8 or floats in [0, 1]), a PIL image, or a local
    file path (``.npy``, or any format PIL reads)."""
    if isinstance(image, (str, Path)):
        path = Path(image).expanduser()
        if path.suffix == ".npy":
            image = np.load(path)
        else:
            try:
                from PIL import Image
            except ImportError:
                raise ImportError(f"reading image {str(path)!r} needs pillow (uv add pillow), or use .npy") from None
            with Image.open(path) as im:
                image = np.asarray(im.convert("RGB"))
    elif not isinstance(image, np.ndarray) and hasattr(image, "convert"):  # PIL
        image = np.asarray(image.convert("RGB"))
    arr = np.asarray(image)
    if arr.dtype != np.uint8:
        arr = (np.clip(arr.astype(np.float64), 0.0, 1.0) * 255).round().astype(np.uint8)
    if arr.ndim == 2:
        arr = np.repeat(arr[:, :, None], 3, axis=2)
    if arr.ndim != 3 or arr.shape[2] != 3:
        raise ValueError(f"image: expected [H, W, 3], got shape {arr.shape}")
    return np.ascontiguousarray(arr)


def check_image(arr: np.ndarray, spec: VisionSpec) -> None:
    h, w = arr.shape[:2]
    f = spec.factor
    if h % f or w % f or not spec.min_pixels <= h * w <= spec.max_pixels:
        raise ValueError(
            f"image of {h}x{w} is not processor-ready: height and width must be multiples of {f} "
            f"and h*w in [{spec.min_pixels}, {spec.max_pixels}] (resize it with "
            "rlcore.models.vision.fit_image)"
        )


def fit_image(image: Any, spec: VisionSpec) -> np.ndarray:
    """Resize (nearest neighbour) to the closest processor-ready size (Qwen2-VL's smart resize)."""
    import math

    arr = to_array(image)
    h, w = arr.shape[:2]
    f = spec.factor
    nh, nw = max(f, round(h / f) * f), max(f, round(w / f) * f)
    if nh * nw > spec.max_pixels:
        beta = math.sqrt(h * w / spec.max_pixels)
        nh, nw = max(f, math.floor(h / beta / f) * f), max(f, math.floor(w / beta / f) * f)
    elif nh * nw < spec.min_pixels:
        beta = math.sqrt(spec.min_pixels / (h * w))
        nh, nw = math.ceil(h * beta / f) * f, math.ceil(w * beta / f) * f
    rows = (np.arange(nh) * h // nh).clip(0, h - 1)
    cols = (np.arange(nw) * w // nw).clip(0, w - 1)
    return np.ascontiguousarray(arr[rows][:, cols])


def grid_thw(arr: np.ndarray, spec: VisionSpec) -> tuple[int, int, int]:
    check_image(arr, spec)
    return 1, arr.shape[0] // spec.patch_size, arr.shape[1] // spec.patch_size


def num_image_tokens(arr: np.ndarray, spec: VisionSpec) -> int:
    t, h, w = grid_thw(arr, spec)
    return t * h * w // spec.merge_size**2


# -- tokens ------------------------------------------------------------------------------------
def expand_image_tokens(
    ids: list[int], images: Sequence[np.ndarray], spec: VisionSpec, mask: list[int] | None = None
) -> tuple[list[int], list[int] | None]:
    """Replace the k-th image token of `ids` by `num_image_tokens(images[k])` copies (`mask`, if
    given, is expanded alongside). The count of image tokens must equal the count of images."""
    tok = spec.image_token_id
    n = sum(1 for t in ids if t == tok)
    if n != len(images):
        raise ValueError(
            f"prompt has {n} image placeholder(s) ({IMAGE_PAD}) for {len(images)} image(s); "
            f"put one {IMAGE_PLACEHOLDER!r} in the message text per image"
        )
    out, out_mask, k = [], [] if mask is not None else None, 0
    for i, t in enumerate(ids):
        reps = num_image_tokens(images[k], spec) if t == tok else 1
        k += t == tok
        out.extend([t] * reps)
        if mask is not None:
            out_mask.extend([mask[i]] * reps)
    return out, out_mask


def collapse_image_tokens(ids: Sequence[int], image_token_id: int) -> list[int]:
    """Inverse of `expand_image_tokens`: every run of image tokens back to one (what vLLM wants
    with token prompts: it expands each placeholder itself)."""
    out: list[int] = []
    for t in ids:
        if t == image_token_id and out and out[-1] == image_token_id:
            continue
        out.append(t)
    return out


def image_runs(ids: Sequence[int], image_token_id: int) -> list[tuple[int, int]]:
    """(start, length) of every run of image tokens."""
    runs, start = [], None
    for i, t in enumerate(list(ids) + [None]):
        if t == image_token_id and start is None:
            start = i
        elif t != image_token_id and start is not None:
            runs.append((start, i - start))
            start = None
    return runs
