"""shape_count: count the shapes in a small generated image; reward is exact match.

Each task draws 1..`max_shapes` filled squares and discs in distinct colours on a plain
background (numpy only, deterministic in (seed, split, index)); the prompt shows the image and
asks how many shapes it holds; the answer is the count as digits. Images are `image_size`
pixels square; it must be a multiple of the policy's ``patch_size * merge_size`` (28 for
Qwen2.5-VL: 56 px is 4 image tokens; 32 for Qwen3-VL and Qwen3.5: 64 px is 4), which the run's
validation checks against the model (`rlcore.plan.validate.vision_problems`).
"""

from __future__ import annotations

import numpy as np

from rlcore.envs.base import Environment, register, rng_for
from rlcore.models.vl_names import IMAGE_PLACEHOLDER
from rlcore.types import Task

COLOURS = [
    (230, 25, 75),
    (60, 180, 75),
    (0, 130, 200),
    (245, 130, 48),
    (145, 30, 180),
    (240, 50, 230),
    (0, 0, 0),
    (128, 128, 0),
]


def draw_shapes(rng, size: int, count: int, cell: int) -> np.ndarray:
    """`count` shapes in distinct cells of a grid of `cell`-pixel cells (so they never overlap)."""
    img = np.full((size, size, 3), 255, dtype=np.uint8)
    per_row = size // cell
    yy, xx = np.mgrid[0:cell, 0:cell]
    for k, slot in enumerate(rng.sample(range(per_row * per_row), count)):
        y0, x0 = (slot // per_row) * cell, (slot % per_row) * cell
        colour = np.array(COLOURS[k % len(COLOURS)], dtype=np.uint8)
        r = cell / 2 - 1
        if rng.random() < 0.5:  # disc
            mask = (yy - cell / 2 + 0.5) ** 2 + (xx - cell / 2 + 0.5) ** 2 <= r * r
        else:  # square with a 1-pixel margin
            mask = (yy >= 1) & (yy < cell - 1) & (xx >= 1) & (xx < cell - 1)
        img[y0 : y0 + cell, x0 : x0 + cell][mask] = colour
    return img


@register("shape_count")
class ShapeCount(Environment):
    """Prompt: an image of 1..max_shapes shapes and a question; answer: the count."""

    uses_images = True
    trusted_reward = True  # the text compared with the count: nothing of it is evaluated

    def __init__(
        self,
        seed: int = 0,
        image_size: int = 56,
        max_shapes: int = 4,
        cell: int = 14,
        question: str = "How many shapes?",
        **common,
    ):
        super().__init__(seed, **common)
        if image_size < 28:
            raise ValueError(f"env.args.image_size: must be at least 28, got {image_size}")
        if cell < 4 or image_size % cell:
            raise ValueError(f"env.args.cell: must be >= 4 and divide image_size={image_size}, got {cell}")
        if not 1 <= max_shapes <= (image_size // cell) ** 2:
            raise ValueError(f"env.args.max_shapes: must be in [1, {(image_size // cell) ** 2}], got {max_shapes}")
        self.image_size, self.max_shapes, self.cell, self.question = image_size, max_shapes, cell, question

    def make_task(self, index: int, split: str) -> Task:
        rng = rng_for(self.seed, split, index)
        count = rng.randint(1, self.max_shapes)
        image = draw_shapes(rng, self.image_size, count, self.cell)
        return Task(
            id=f"shape_count/{split}/{index}",
            messages=[{"role": "user", "content": IMAGE_PLACEHOLDER + self.question}],
            answer=str(count),
            images=[image],
        )

    def reward(self, task: Task, completion: str) -> float:
        return float(completion.strip() == task.answer)
