"""Weight sync hands vLLM's loader the family's checkpoint names (`rlcore.models.checkpoint_names`,
installed in front of every vLLM worker's ``load_weights``), for every tiny family config.

What vLLM accepts is derived, not listed: vLLM loads Hugging Face checkpoints, so the names
``save_pretrained`` writes for a freshly built model of the family are accepted, each with its
tensor. The one other form is vLLM's fused-expert form (vLLM 0.26
``RoutedExperts.build_expert_params_mapping(include_fused=True)``, used by every family's loader
but DeepSeek-V3's): ``P.experts.gate_up_proj`` / ``P.experts.w13`` for the per-expert gate and up
tensors ``P.experts.{i}.{gate_proj|w1}.weight`` / ``...{up_proj|w3}.weight`` of the checkpoint
(chunked in two along dim 1, gate first) and ``P.experts.down_proj`` / ``P.experts.w2`` for the
per-expert down tensors; a fused name is accepted when it stands for per-expert names the
checkpoint has, and its slices must equal them."""

from __future__ import annotations

import copy
import re

import pytest
import torch
import yaml
from safetensors.torch import load_file

from rlcore.config import ModelConfig
from rlcore.models.build import build_model, build_tokenizer
from rlcore.models.checkpoint_names import CheckpointNames, reference_model, sends_fused_experts
from rlcore.plan.compose import REPO
from rlcore.trainer.export import full_parameters
from rlcore.trainer.moe import apply_expert_parallel

FAMILIES = [
    "tiny_moe_char",
    "tiny_mixtral_char",
    "tiny_gpt_oss_char",
    "tiny_deepseek_v3_char",
    "tiny_glm4_moe_char",
    "tiny_qwen3_next",
    "tiny_nemotron_h",
    "tiny_qwen3_vl",
    "tiny_qwen3_vl_moe",
    "tiny_qwen3_5",
    "tiny_qwen3_5_moe",
    "tiny_vl",
]
_FUSED = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<fused>gate_up_proj|w13|down_proj|w2)$")
_PARTS = {"gate_up_proj": ("gate_proj", "up_proj"), "w13": ("w1", "w3"), "down_proj": ("down_proj",), "w2": ("w2",)}


def accepted_slices(name: str, tensor: torch.Tensor, ckpt: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """The checkpoint (name, tensor) pairs a sent tensor stands for under vLLM's loader: itself,
    or the per-expert slices of a fused-expert name."""
    if name in ckpt:
        return [(name, tensor)]
    m = _FUSED.match(name)
    assert m is not None, f"{name!r} is neither a checkpoint name nor vLLM's fused-expert form"
    parts = _PARTS[m["fused"]]
    halves = tensor.chunk(len(parts), dim=1)
    return [
        (f"{m['prefix']}.{e}.{proj}.weight", half[e])
        for proj, half in zip(parts, halves)
        for e in range(tensor.shape[0])
    ]


@pytest.mark.parametrize("name", FAMILIES)
def test_sync_sends_names_and_tensors_vllm_loads(name, tmp_path):
    cfg = ModelConfig(**yaml.safe_load((REPO / "conf" / "model" / f"{name}.yaml").read_text()))
    hf_model = build_model(cfg, build_tokenizer(cfg))
    hf_model.save_pretrained(tmp_path)
    ckpt = load_file(str(tmp_path / "model.safetensors"))
    trainer_model = copy.deepcopy(hf_model)
    apply_expert_parallel(trainer_model, None)  # the trainer's MoE blocks, as TrainerCore holds them

    # what a vLLM worker does with every load_weights call (vllm_worker.rlcore_use_checkpoint_names),
    # from a config of another class for the same model type (vLLM has its own for Qwen3-Next,
    # Qwen3.5, and registers it with AutoConfig over transformers' own: Qwen3.5 failed on the GPU so)
    from transformers import AutoConfig, PretrainedConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    model_type = hf_model.config.model_type
    foreign = type("EngineConfig", (PretrainedConfig,), {"model_type": model_type})
    engine_config = foreign.from_dict(hf_model.config.to_dict())
    registered = dict(CONFIG_MAPPING._extra_content)
    AutoConfig.register(model_type, foreign, exist_ok=True)
    try:
        names = CheckpointNames(reference_model(engine_config), sends_fused_experts(engine_config))
    finally:
        CONFIG_MAPPING._extra_content.clear()
        CONFIG_MAPPING._extra_content.update(registered)
    covered: set[str] = set()
    for _ in range(2):  # the second sync goes through the per-name memo
        sent = list(names.named(full_parameters(trainer_model)))
        covered = set()
        for wire, tensor in sent:
            for ck, piece in accepted_slices(wire, tensor, ckpt):
                assert ck in ckpt, f"{name}: sync sends {wire!r}, standing for {ck!r}, which the checkpoint lacks"
                torch.testing.assert_close(piece, ckpt[ck], atol=0, rtol=0, msg=f"{name}: {wire} -> {ck}")
                covered.add(ck)
    buffers = {n for n, _ in names.named(hf_model.named_buffers()) if n in ckpt}  # e.g. a router's correction bias
    assert covered | buffers == set(ckpt), f"{name}: the sync never sends {sorted(set(ckpt) - covered - buffers)[:5]}"
    if name == "tiny_mixtral_char":  # the GPU failure this guards: vLLM's Mixtral has block_sparse_moe, not mlp
        assert {w for w, _ in sent} >= {
            "model.layers.0.block_sparse_moe.experts.w13",
            "model.layers.0.block_sparse_moe.gate.weight",
        }
    if name == "tiny_deepseek_v3_char":  # vLLM's DeepSeek loader knows per-expert tensors only
        assert not any(_FUSED.match(w) for w, _ in sent)
