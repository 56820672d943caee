"""A model family's checkpoint names: the one mapping from transformers' in-memory parameter names
to the names a Hugging Face checkpoint of that family holds, shared by export and weight sync.

transformers 5 renames and fuses some families' weights in memory and its conversion mapping
undoes that on ``save_pretrained`` (`revert_weight_conversion`): Mixtral's
``mlp.experts.gate_up_proj`` ``[E, 2I, H]`` is saved as ``block_sparse_moe.experts.{i}.w1/w3.weight``,
the MoE families' fused experts as ``mlp.experts.{i}.gate_proj/up_proj/down_proj.weight``,
Nemotron-H's ``model.`` as ``backbone.``. vLLM loads those checkpoints, so its ``load_weights``
accepts exactly those names. Export writes them (:func:`checkpoint_named`); the vLLM engine
translates every weight it is handed through the same function (`rlcore.engine.vllm.vllm_worker`),
so the NCCL, CUDA IPC and RPC syncs and an engine's load from a checkpoint all arrive under names
the family's vLLM loader knows.

One shortcut, for speed: where the family's vLLM model loads its routed experts through vLLM's
``FusedMoE`` loader (which takes a whole pre-fused expert tensor: ``experts.gate_up_proj`` /
``experts.w13`` ``[E, 2I, H]``, chunked in two along dim 1 for gate and up, and
``experts.down_proj`` / ``experts.w2`` ``[E, H, I]``), weight sync sends the fused tensor under that
fused name instead of 3E per-expert slices (`MoEFamily.vllm_fused_experts`). DeepSeek-V3's vLLM
loader only knows per-expert names, so its experts are sent split.
"""

from __future__ import annotations

import re
from typing import Any, Iterable, Iterator

import torch

from rlcore.models.moe_family import FAMILIES

_EXPERT = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<index>\d+)\.(?P<proj>[A-Za-z0-9_]+)\.weight$")
_FUSED_PAIRS = {frozenset(("gate_proj", "up_proj")): "gate_up_proj", frozenset(("w1", "w3")): "w13"}
"""Per-expert gate/up checkpoint names -> vLLM's fused name for them (`RoutedExperts.build_expert_params_mapping`)."""


def fused_expert_name(names: list[str]) -> str | None:
    """vLLM's fused-expert name for the per-expert checkpoint names one fused tensor saves as
    (``P.experts.{i}.gate_proj.weight`` + ``...up_proj.weight`` -> ``P.experts.gate_up_proj``;
    ``...w1`` + ``...w3`` -> ``P.experts.w13``; one projection ``x`` -> ``P.experts.x``), or None
    when the names are not one expert set (every index 0..E-1 of the same projections)."""
    parts = [_EXPERT.match(n) for n in names]
    if not parts or any(p is None for p in parts):
        return None
    prefixes = {p["prefix"] for p in parts}
    projs = frozenset(p["proj"] for p in parts)
    indices = {int(p["index"]) for p in parts}
    if len(prefixes) != 1 or indices != set(range(len(indices))) or len(names) != len(indices) * len(projs):
        return None
    fused = _FUSED_PAIRS.get(projs) if len(projs) == 2 else (next(iter(projs)) if len(projs) == 1 else None)
    return f"{prefixes.pop()}.{fused}" if fused else None


def sends_fused_experts(config: Any) -> bool:
    """Whether the family's vLLM loader takes whole fused expert tensors (module docstring)."""
    text = getattr(config, "text_config", None) or config
    model_type = text.get("model_type") if isinstance(text, dict) else getattr(text, "model_type", "")
    fam = FAMILIES.get(str(model_type))
    return fam is not None and fam.vllm_fused_experts


def checkpoint_named(
    model: torch.nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]], fuse_experts: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """`named_tensors` (transformers module names of `model`'s family) under the family's checkpoint
    names, one tensor at a time (a writer keeps streaming): transformers' own reverse conversion,
    what ``save_pretrained`` applies. A dense model's names pass through unchanged. `fuse_experts`:
    a fused expert tensor keeps its layout under vLLM's fused name (:func:`fused_expert_name`)
    instead of being split into the per-expert tensors a checkpoint holds. `model` is only read
    for its class and config (a meta-device model serves)."""
    yield from CheckpointNames(model, fuse_experts).named(named_tensors)


class CheckpointNames:
    """:func:`checkpoint_named` with a per-name memo: a name that maps to one tensor unchanged
    (renamed or not) or to a fused expert name skips the conversion machinery the next time (a
    weight sync sends the same names every step)."""

    def __init__(self, model: torch.nn.Module, fuse_experts: bool = False):
        self.model, self.fuse_experts = model, fuse_experts
        self._renamed: dict[str, str] = {}

    def named(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        from transformers.core_model_loading import revert_weight_conversion

        for name, tensor in named_tensors:
            known = self._renamed.get(name)
            if known is not None:
                yield known, tensor
                continue
            out = revert_weight_conversion(self.model, {name: tensor})
            if len(out) == 1:
                ((new, value),) = out.items()
                if value is tensor:
                    self._renamed[name] = new
                yield new, value
                continue
            fused = fused_expert_name(list(out)) if self.fuse_experts else None
            if fused is not None:
                self._renamed[name] = fused
                yield fused, tensor
                continue
            yield from out.items()


def reference_model(config: Any) -> torch.nn.Module | None:
    """A meta-device transformers model of `config`'s family (no memory): what
    :func:`checkpoint_named` reads the family's conversion mapping from, on the engine side.
    `config` may be another library's class for the model type (vLLM 0.26 has its own for
    Qwen3-Next, Qwen3.5, Nemotron-H, and registers it with `AutoConfig` in place of transformers'
    own): it is rebuilt as transformers' own class, found by name, from its dict. None for a model
    type transformers does not know (remote code: no conversion mapping, names pass as they are)."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    model_type = getattr(config, "model_type", None)
    own = getattr(transformers, CONFIG_MAPPING_NAMES.get(model_type, ""), None)  # not what AutoConfig now maps
    if own is None:
        return None
    if type(config) is not own:
        config = own.from_dict(config.to_dict())
    auto = AutoModelForImageTextToText if getattr(config, "vision_config", None) is not None else AutoModelForCausalLM
    with torch.device("meta"):
        return auto.from_config(config)
