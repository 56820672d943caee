"""Engine arguments the plan derives from the run for a vLLM engine (its registry hook), torch-free:
they are set before Ray starts, so every engine of the run starts with the same ones.

CUDA-graph capture sizes. vLLM captures one graph per batch size in its default list (1, 2, 4, then
every 8 up to 256 and every 16 up to min(2 x max_num_seqs, 512): 51 sizes, each captured piecewise
and again as a full decode graph), whatever the run can reach. A run's engine never holds more
sequences at once than the rollout schedule puts in flight (`max_sequences`), so the largest size
is capped there, and the sizes are spaced geometrically (steps of 8 up to 32, then at most 25%
padding): `capture_sizes` gives 23 sizes for a 512 cap, about 2.2 times fewer captures. A decode batch pads
up to the next captured size; one above the largest runs without a graph.
"""

from __future__ import annotations

from typing import Any

VLLM_MAX_CAPTURE = 512
"""vLLM's own cap on the largest captured batch (`max_cudagraph_capture_size` default)."""
GRAPH_KEYS = ("cudagraph_capture_sizes", "max_cudagraph_capture_size", "compilation_config")
"""Engine arguments of the user's that decide the capture sizes themselves (kept as given)."""


def capture_sizes(max_sequences: int, cap: int = VLLM_MAX_CAPTURE) -> list[int]:
    """Batch sizes to capture for an engine that holds at most `max_sequences` at once: 1, 2, 4, 8,
    then steps of at most a quarter of the size (16, 24, ..., 64, 80, 96, 112, 128, 160, ...), up to the first size >= min(max_sequences, cap), which is included."""
    top = max(1, min(int(max_sequences), cap))
    sizes, size = [], 1
    while True:
        sizes.append(size)
        if size >= top:
            return sizes
        if size < 8:
            size *= 2
        else:
            step = 8
            while step * 2 <= size // 4:  # the largest power-of-two step within a quarter of the size
                step *= 2
            size += step


def planned_kwargs(options: Any, max_sequences: int) -> dict[str, Any]:
    """`engine_kwargs` for the section `options` (a `VLLMOptions`) of a run whose engine holds at
    most `max_sequences` sequences at once (and at most its `max_num_seqs`): the capture sizes
    (`capture_sizes`), unless the user's `engine_kwargs` decide them (`GRAPH_KEYS`) or turn
    graphs off (`enforce_eager`)."""
    given = options.engine_kwargs
    if given.get("enforce_eager") or any(k in given for k in GRAPH_KEYS):
        return {}
    if given.get("max_num_seqs"):  # the engine never batches more than that
        max_sequences = min(max_sequences, int(given["max_num_seqs"]))
    return {"cudagraph_capture_sizes": capture_sizes(max_sequences)}
