"""FP8 matmuls in the trainer (``trainer.fp8``) through torchao's float8 training.

`apply_float8` swaps the selected ``nn.Linear`` modules for torchao's ``Float8Linear`` in place
(same ``weight`` / ``bias`` Parameters: names, tying, weight sync and checkpoints are unchanged).
Their forward and both backward matmuls run as FP8 ``_scaled_mm`` with dynamic scales (e4m3
inputs and weights, e5m2 output gradients for ``tensorwise``; e4m3 row-wise scales for
``rowwise``); weights, gradients and optimizer state keep their dtypes. It must run before FSDP2
``fully_shard`` (`rlcore.trainer.parallel.parallelize` calls it after LoRA / expert parallelism and
before activation checkpointing).

Which layers (`fp8_module_filter`): the decoder's ``nn.Linear`` projections (attention q/k/v/o,
MLP gate/up/down) whose in and out features are multiples of 16 (FP8 GEMM tile constraint). Never
the ``lm_head`` (the chunked logprob head keeps it in bf16: logprob precision matters for the
importance ratios), embeddings, MoE router gates (small, precision-sensitive routing) or anything
that is not an ``nn.Linear`` (MoE experts are fused 3-D tensors; LoRA adapters).

FSDP2 float8 all-gather (``enable_fsdp_float8_all_gather``) stays off: it wraps the sharded
weights in a tensor subclass that the weight-sync gather, DCP checkpoints and HF export have not
been checked with, and it only saves all-gather bandwidth (a multi-node concern).

Hardware: FP8 ``_scaled_mm`` needs compute capability >= 8.9 (Hopper H100/H200, Ada); config
validation rejects ``trainer.fp8`` on CPU. ``emulate=True`` (CPU unit tests only) runs the same
casts with fp32 matmuls. torchao is imported lazily (the ``fp8`` extra: ``pip install
'rlcore[fp8]'``, torchao 0.17.0 for torch 2.11).
"""

from __future__ import annotations

import dataclasses

from torch import nn

from rlcore.trainer.options import FP8_RECIPES as RECIPES

_SKIP_NAMES = ("lm_head", "gate", "router", "shared_expert_gate")


def _check_gpu() -> None:
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("trainer.fp8 needs a CUDA GPU with compute capability >= 8.9 (Hopper/Ada); none is visible")
    cap = torch.cuda.get_device_capability()
    if cap < (8, 9):
        raise RuntimeError(
            f"trainer.fp8 needs compute capability >= 8.9 (Hopper/Ada) for FP8 matmuls; "
            f"{torch.cuda.get_device_name()} has {cap[0]}.{cap[1]}: use trainer.fp8=none"
        )


def fp8_module_filter(module: nn.Module, fqn: str) -> bool:
    """True for the ``nn.Linear`` layers whose matmuls run in FP8 (module docstring)."""
    if not isinstance(module, nn.Linear):
        return False
    last = fqn.rsplit(".", 1)[-1]
    if last in _SKIP_NAMES or "embed" in fqn or "router" in fqn:
        return False
    return module.in_features % 16 == 0 and module.out_features % 16 == 0


def fp8_linear_names(model: nn.Module) -> list[str]:
    """Names of the modules `apply_float8` converts (without converting anything)."""
    return [name for name, m in model.named_modules() if name and fp8_module_filter(m, name)]


def apply_float8(model: nn.Module, recipe: str, emulate: bool = False) -> list[str]:
    """Convert the selected linears of ``model`` in place to FP8 training; returns their names
    (empty for ``recipe="none"``). Raises ``ImportError`` with the install hint without torchao."""
    if recipe == "none":
        return []
    if recipe not in RECIPES:
        raise ValueError(f"trainer.fp8: unknown recipe {recipe!r}; choose one of {list(RECIPES)}")
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as exc:
        raise ImportError("trainer.fp8 needs torchao: pip install 'rlcore[fp8]' (torchao==0.17.0)") from exc
    if not emulate:
        _check_gpu()
    names = fp8_linear_names(model)
    if not names:
        return []
    config = Float8LinearConfig.from_recipe_name(recipe)
    if emulate:
        config = dataclasses.replace(config, emulate=True)
    convert_to_float8_training(model, config=config, module_filter_fn=fp8_module_filter)
    return names
