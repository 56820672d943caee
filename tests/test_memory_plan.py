"""The colocated memory plan: parameter counts match the real model, footprints move the right
way with each knob, and a layout that does not fit gives one line with the numbers."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlcore.models.build import build_tokenizer, random_model_config
from rlcore.plan.compose import compose
from rlcore.plan.memory import (
    GIB,
    MAX_ENGINE_FRACTION,
    colocated_engine_fraction,
    engine_min_bytes,
    memory_problems,
    param_count,
    trainer_memory,
)

SHAPE_4B = [
    "model.arch.hidden_size=2560",
    "model.arch.intermediate_size=9728",
    "model.arch.num_hidden_layers=36",
    "model.arch.num_attention_heads=32",
    "model.arch.num_key_value_heads=8",
]
H200 = int(139.8 * GIB)


@pytest.mark.parametrize("extra", [[], SHAPE_4B])
def test_param_count_matches_the_model(extra):
    cfg = compose(["model=qwen3_06b_char", *extra])
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(random_model_config(cfg.model, build_tokenizer(cfg.model)))
    real = sum(p.numel() for p in model.parameters())
    assert abs(param_count(cfg) - real) / real < 0.01


def test_footprint_follows_the_knobs():
    base = trainer_memory(compose(["model=qwen3_06b_char"]))
    more_tokens = trainer_memory(compose(["model=qwen3_06b_char", "trainer.micro_batch_tokens=16384"]))
    checkpointed = trainer_memory(compose(["model=qwen3_06b_char", "trainer.activation_checkpointing=full"]))
    bf16 = trainer_memory(compose(["model=qwen3_06b_char", "trainer.param_dtype=bfloat16"]))
    two_ranks = trainer_memory(compose(["model=qwen3_06b_char", "trainer.world_size=2"]))
    assert more_tokens.activations > 3 * base.activations and more_tokens.state == base.state
    assert checkpointed.activations < base.activations / 4
    assert bf16.state < base.state and two_ranks.state < base.state
    assert base.resident < base.peak
    assert base.sync_buffer == param_count(compose(["model=qwen3_06b_char"])) * 2


def test_engine_share_and_fit():
    small, big = compose(["model=qwen3_06b_char"]), compose(["model=qwen3_06b_char", *SHAPE_4B])
    assert colocated_engine_fraction(small, H200) == MAX_ENGINE_FRACTION
    share = colocated_engine_fraction(big, H200)
    assert share * H200 > engine_min_bytes(big)
    assert (trainer_memory(big).peak + share * H200) < H200
    assert memory_problems(small, H200) == []
    asleep = compose(
        [
            "model=qwen3_06b_char",
            *SHAPE_4B,
            "rollout.engine=vllm",
            "rollout.vllm.sleep_level=2",
            "algo.max_off_policy_steps=0",
        ]
    )
    assert colocated_engine_fraction(asleep, H200) > share  # a sleeping engine sits beside the resident part
    too_small = memory_problems(big, 40 * GIB)
    assert len(too_small) == 1 and "do not fit" in too_small[0][1] and "40.0 GiB GPU" in too_small[0][1]


def test_unknown_shape_is_not_planned():
    cfg = compose(["model=qwen3_06b_char"])
    cfg.model.arch = {"model_type": "qwen3"}
    assert param_count(cfg) is None and trainer_memory(cfg) is None
    assert colocated_engine_fraction(cfg, H200) is None and memory_problems(cfg, H200) == []
