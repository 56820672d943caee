"""What the plan fixes for a vLLM engine before Ray starts (issue 43): a colocated engine's cache
bytes (so it sizes nothing from the memory free at its start and the trainer rank starts and warms
up beside it), and CUDA-graph capture sizes the run can reach; the user's own settings win."""

from itertools import pairwise

import pytest

from actors.weights import engines_sized_by_plan
from rlcore.engine.vllm.vllm_plan import VLLM_MAX_CAPTURE, capture_sizes
from rlcore.plan.compose import compose
from rlcore.plan.memory import (
    ENGINE_WORKSPACE_GIB,
    GIB,
    max_sequences_per_engine,
    param_count,
)
from rlcore.plan.placement import placement_problems, resolve

H200 = int(139.8 * GIB)
VLLM_1_1 = ["model=qwen3_06b_char", "rollout.engine=vllm", "trainer.gpus_per_rank=1", "rollout.gpus_per_actor=1"]
SHAPE_4B = [
    "model.arch.hidden_size=2560",
    "model.arch.intermediate_size=9728",
    "model.arch.num_hidden_layers=36",
    "model.arch.num_attention_heads=32",
    "model.arch.num_key_value_heads=8",
]
GRAPHS = ["rollout.vllm.engine_kwargs.enforce_eager=false"]  # the recipe's own setting, stated


def test_colocated_engine_cache_is_its_share_less_weights_and_workspace():
    for extra in ([], SHAPE_4B):
        cfg = resolve(compose(VLLM_1_1 + extra), 1, H200)
        kw = cfg.rollout.vllm.engine_kwargs
        expected = kw["gpu_memory_utilization"] * H200 - 2 * param_count(cfg) - ENGINE_WORKSPACE_GIB * GIB
        assert 0 <= expected - kw["kv_cache_memory_bytes"] < 2**20  # floored to a MiB
        assert kw["kv_cache_memory_bytes"] % 2**20 == 0
        assert engines_sized_by_plan(cfg)  # so the trainer starts while the engine starts
        assert placement_problems(cfg, 1, H200, "this machine") == []
    small = resolve(compose(VLLM_1_1), 1, H200).rollout.vllm.engine_kwargs["kv_cache_memory_bytes"]
    big = resolve(compose(VLLM_1_1 + SHAPE_4B), 1, H200).rollout.vllm.engine_kwargs["kv_cache_memory_bytes"]
    assert big < small  # the 4B trainer leaves its engine a smaller share, which holds larger weights


def test_user_share_and_user_budget():
    share = resolve(compose(VLLM_1_1 + ["+rollout.vllm.engine_kwargs.gpu_memory_utilization=0.3"]), 1, H200)
    assert share.rollout.vllm.engine_kwargs["kv_cache_memory_bytes"] < 0.3 * H200 - ENGINE_WORKSPACE_GIB * GIB
    given = resolve(compose(VLLM_1_1 + ["+rollout.vllm.engine_kwargs.kv_cache_memory_bytes=1073741824"]), 1, H200)
    assert given.rollout.vllm.engine_kwargs["kv_cache_memory_bytes"] == 2**30 and engines_sized_by_plan(given)


@pytest.mark.parametrize(
    "overrides,gpus,gpu_bytes",
    [
        (
            ["rollout.vllm.sleep_level=2", "algo.max_off_policy_steps=0"],
            1,
            H200,
        ),  # the trainer's peak fits only while it sleeps
        ([], 2, H200),  # split: each on its own GPU, nothing shared
        ([], 1, None),  # the GPU's size unknown: the engine measures
        (["+rollout.vllm.engine_kwargs.gpu_memory_utilization=0.03"], 1, H200),  # under 2 GiB of cache left
    ],
)
def test_no_budget_where_the_engine_must_measure(overrides, gpus, gpu_bytes):
    cfg = resolve(compose(VLLM_1_1 + overrides), gpus, gpu_bytes)
    assert "kv_cache_memory_bytes" not in cfg.rollout.vllm.engine_kwargs
    assert not engines_sized_by_plan(cfg)


def test_no_budget_beside_a_gpu_teacher():
    cfg = resolve(compose(["+recipe=distill_smollm2"]), 1, H200)
    assert cfg.placed == "colocated" and not engines_sized_by_plan(cfg)


def test_capture_sizes_are_capped_and_spaced():
    assert capture_sizes(1) == [1] and capture_sizes(3) == [1, 2, 4]
    for n in (5, 9, 100, 130, 300, 511, 512, 640, 5000):
        sizes = capture_sizes(n)
        assert sizes == sorted(set(sizes)) and sizes[:4] == [1, 2, 4, 8][: len(sizes[:4])]
        assert sizes[-1] >= min(n, VLLM_MAX_CAPTURE) and (len(sizes) == 1 or sizes[-2] < min(n, VLLM_MAX_CAPTURE))
        assert all(b <= 1.25 * a for a, b in pairwise(sizes) if a >= 32)  # padding <= 25% from 32 up
        assert all(b - a <= 8 for a, b in pairwise(sizes) if 8 <= a < 32)  # steps of 8 below
    assert len(capture_sizes(512)) <= 24  # vLLM's own list for 512: 51 sizes


def test_the_recipe_engine_captures_what_its_schedule_reaches():
    cfg = compose(["+recipe=reverse_text_smollm2"] + GRAPHS)
    assert max_sequences_per_engine(cfg) == (2 * 16 + 8) * 16  # (off-policy + 1) x batch_groups + a request, x 16
    kw = resolve(cfg, 1, H200).rollout.vllm.engine_kwargs
    assert kw["cudagraph_capture_sizes"] == capture_sizes(640) and kw["cudagraph_capture_sizes"][-1] == 512
    sync_small = compose(
        [
            "+recipe=reverse_text_smollm2",
            "algo.max_off_policy_steps=0",
            "algo.batch_groups=2",
            "rollout.tasks_per_request=2",
            "algo.group_size=8",
        ]
        + GRAPHS
    )
    assert resolve(sync_small, 1, H200).rollout.vllm.engine_kwargs["cudagraph_capture_sizes"][-1] == 32
    few_seqs = compose(["+recipe=reverse_text_smollm2", "+rollout.vllm.engine_kwargs.max_num_seqs=100"] + GRAPHS)
    assert resolve(few_seqs, 1, H200).rollout.vllm.engine_kwargs["cudagraph_capture_sizes"][-1] == 112


@pytest.mark.parametrize(
    "given",
    [
        ["+rollout.vllm.engine_kwargs.enforce_eager=true"],
        ["+rollout.vllm.engine_kwargs.max_cudagraph_capture_size=64"],
        ["+rollout.vllm.engine_kwargs.cudagraph_capture_sizes=[1,8]"],
    ],
)
def test_user_graph_settings_are_left_alone(given):
    kw = resolve(compose(VLLM_1_1 + given), 1, H200).rollout.vllm.engine_kwargs
    assert "cudagraph_capture_sizes" not in kw or kw["cudagraph_capture_sizes"] == [1, 8]
    assert "kv_cache_memory_bytes" in kw  # the cache budget does not depend on graphs
