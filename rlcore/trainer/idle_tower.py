"""A vision-language policy's tower in a micro-batch without images, on several ranks.

`rlcore.trainer.parallel.parallelize` makes the vision tower an FSDP unit of its own: it gathers
its parameters when it runs and reduce-scatters their gradients after backward, and every rank of
the mesh must take part in both. A rank whose micro-batch holds no image (a text-only sample,
the empty micro-batch that evens out the ranks' counts) skips the tower while a rank with images
runs it, and the collectives no longer pair up: gloo aborts on the size mismatch, NCCL would wait out
its timeout. So such a rank runs the tower on one blank merge window and adds 0 times its outputs
to the language model's input embeddings: the gather happens where the image forward's does
(inside the root forward, before the first decoder layer), and the tower's gradients (zeros)
reach backward after the decoder layers', in the image rank's order. The logprobs are unchanged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from rlcore.models.vision import vision_tower


def needs_idle_tower(model: torch.nn.Module, fsdp_ranks: int) -> bool:
    """Whether a micro-batch without images must still run `model`'s tower: a vision-language
    model sharded over more than one rank."""
    return fsdp_ranks > 1 and vision_tower(model) is not None


def blank_image_input(model: torch.nn.Module, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(pixel_values, image_grid_thw) of one blank merge window in the tower's own patch layout:
    ``[m * m, C * T * P * P]`` zeros and ``[[1, m, m]]`` (m: spatial_merge_size)."""
    vc = model.config.vision_config
    channels = getattr(vc, "in_channels", None) or getattr(vc, "in_chans", 3)
    m = int(getattr(vc, "spatial_merge_size", 1))
    width = channels * int(getattr(vc, "temporal_patch_size", 1)) * int(vc.patch_size) ** 2
    tower = vision_tower(model)
    dtype = next(tower.parameters()).dtype
    pixels = torch.zeros(m * m, width, dtype=dtype, device=device)
    return pixels, torch.tensor([[1, m, m]], dtype=torch.long, device=device)


def _tensors(out: Any) -> Iterator[torch.Tensor]:
    """Every tensor of a tower's output (a tensor, a tuple or list, a ModelOutput), nested."""
    if isinstance(out, torch.Tensor):
        yield out
    elif isinstance(out, dict):  # transformers' ModelOutput is an OrderedDict of its set fields
        for v in out.values():
            yield from _tensors(v)
    elif isinstance(out, (tuple, list)):
        for v in out:
            yield from _tensors(v)


@contextlib.contextmanager
def idle_tower(model: torch.nn.Module, device: torch.device) -> Iterator[None]:
    """Inside it, `model`'s next forward runs its tower on a blank image and adds 0 times the
    sum of every output of it to the language model's ``inputs_embeds`` (see the module's text)."""
    language_model = model.model.language_model
    fired = []

    def hook(module, args, kwargs):
        embeds = kwargs.get("inputs_embeds")
        if embeds is None:
            raise RuntimeError(
                f"{type(model).__name__}: its language model was called without inputs_embeds; rlcore "
                "cannot keep the vision tower's collectives in step on a rank without images"
            )
        pixels, grid = blank_image_input(model, device)
        zero = sum(t.float().sum() for t in _tensors(vision_tower(model)(pixels, grid_thw=grid))) * 0.0
        kwargs["inputs_embeds"] = embeds + zero.to(embeds.dtype)
        fired.append(True)
        return args, kwargs

    handle = language_model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()
    if not fired:
        raise RuntimeError(f"{type(model).__name__}: the forward never reached its language model")
