"""Placement (auto / colocated / split), resolved before Ray starts: the one-GPU layout becomes
colocated, every impossible layout gets one line naming its key and exit code 2."""

import pytest

from rlcore.plan.compose import compose
from rlcore.plan.layout import make_plan
from rlcore.plan.memory import GIB
from rlcore.plan.placement import placement_problems, resolve, resolve_placement
from rlcore.plan.validate import resource_problems
from rlcore.run import main

H200 = 139.8 * GIB
VLLM_1_1 = ["model=qwen3_06b_char", "rollout.engine=vllm", "trainer.gpus_per_rank=1", "rollout.gpus_per_actor=1"]
SHAPE_4B = [
    "model.arch.hidden_size=2560",
    "model.arch.intermediate_size=9728",
    "model.arch.num_hidden_layers=36",
    "model.arch.num_attention_heads=32",
    "model.arch.num_key_value_heads=8",
]


@pytest.mark.parametrize(
    "overrides,gpus,expected",
    [
        (VLLM_1_1, 1, "colocated"),  # the one-GPU command: split needs 2
        (VLLM_1_1, 2, "split"),  # split fits
        (
            ["model=qwen3_06b_char", "rollout.engine=vllm", "trainer.gpus_per_rank=0.5", "rollout.gpus_per_actor=0.5"],
            2,
            "colocated",
        ),  # fractions would share a GPU anyway
        (VLLM_1_1 + ["trainer.world_size=2", "rollout.num_actors=2"], 2, "colocated"),
        (VLLM_1_1 + ["rollout.vllm.tensor_parallel_size=2", "rollout.gpus_per_actor=2"], 1, "split"),  # not colocatable
        (VLLM_1_1 + ["rollout.num_actors=2"], 1, "split"),
        ([], 0, "split"),  # CPU default
        (VLLM_1_1 + ["mode=sft"], 1, "split"),
        (VLLM_1_1 + ["placement=split"], 1, "split"),
        (VLLM_1_1 + ["placement=colocated"], 4, "colocated"),
    ],
)
def test_resolve_placement(overrides, gpus, expected):
    assert resolve_placement(compose(overrides), gpus) == expected


def test_one_gpu_command_is_colocated_with_planned_engine_share():
    """The combination recipes rely on: gpus_per_rank=1, gpus_per_actor=1, one GPU."""
    cfg = resolve(compose(VLLM_1_1), 1, int(H200))
    assert cfg.placed == "colocated" and cfg.placement == "auto"  # the user's choice stays
    assert cfg.rollout.vllm.engine_kwargs["gpu_memory_utilization"] == 0.6
    assert placement_problems(cfg, 1, int(H200), "this machine") == []
    assert resource_problems(cfg, 16, 1, "this machine") == []
    big = resolve(compose(VLLM_1_1 + SHAPE_4B), 1, int(H200))  # the trainer leaves the engine less
    assert 0.05 < big.rollout.vllm.engine_kwargs["gpu_memory_utilization"] < 0.2
    assert placement_problems(big, 1, int(H200), "this machine") == []
    explicit = resolve(compose(VLLM_1_1 + ["+rollout.vllm.engine_kwargs.gpu_memory_utilization=0.3"]), 1, int(H200))
    assert explicit.rollout.vllm.engine_kwargs["gpu_memory_utilization"] == 0.3


def test_dry_run_shows_the_colocated_group(capsys):
    assert main(VLLM_1_1 + ["cluster.num_gpus=1", "cluster.gpu_memory_gib=139.8", "dry_run=true"]) == 0
    out = capsys.readouterr().out
    assert "placement group 'rlcore-colocated' (PACK): 1 bundles of {CPU: 2, GPU: 1}" in out
    assert "rlcore-rollout" not in out and "CUDA IPC" in out and "gpu_memory_utilization=0.6" in out
    plan = make_plan(
        compose(VLLM_1_1 + ["trainer.world_size=2", "rollout.num_actors=2", "cluster.num_gpus=2", "cluster.num_cpus=8"])
    )
    assert plan.config.placed == "colocated" and [b.gpus for b in plan.trainer] == [1, 1] and plan.rollout == []
    assert plan.problems == []


ONE_GPU = VLLM_1_1 + ["cluster.num_gpus=1", "cluster.gpu_memory_gib=139.8"]


@pytest.mark.parametrize(
    "overrides,key",
    [
        (["placement=sideways"], "placement"),
        (
            ["placement=colocated", "rollout.vllm.tensor_parallel_size=2", "rollout.gpus_per_actor=1"],
            "rollout.vllm.tensor_parallel_size",
        ),
        (["placement=colocated", "rollout.num_actors=2"], "rollout.num_actors"),
        (["placement=colocated", "trainer.world_size=2", "rollout.num_actors=2"], "cluster.nodes"),  # 2 ranks, 1 GPU
        (["placement=colocated", "rollout.engine=hf"], "rollout.engine"),
        (["placement=colocated", "rollout.vllm.quantization=fp8"], "rollout.vllm.quantization"),
        (["placement=colocated", "rollout.vllm.weight_reload=layerwise"], "rollout.vllm.weight_reload"),
        (["placement=colocated", "trainer.gpus_per_rank=0"], "placement"),
        (["rollout.vllm.sleep_level=2"], "rollout.vllm.sleep_level"),  # async (max_off_policy_steps=1) cannot sleep
        (
            ["rollout.vllm.sleep_level=2", "algo.max_off_policy_steps=0", "eval.every_n_steps=2"],
            "rollout.vllm.sleep_level",
        ),
        (["rollout.vllm.sleep_level=3"], "rollout.vllm.sleep_level"),
        (["placement=split", "rollout.vllm.sleep_level=1", "algo.max_off_policy_steps=0"], "cluster.nodes"),
        (
            ["+rollout.vllm.engine_kwargs.gpu_memory_utilization=0.95"],
            "rollout.vllm.engine_kwargs.gpu_memory_utilization",
        ),
        (SHAPE_4B + ["trainer.micro_batch_tokens=16384"], "trainer.micro_batch_tokens"),
        (SHAPE_4B + ["model.arch.num_hidden_layers=72"], "placement"),  # too big even asleep
    ],
)
def test_impossible_colocated_layouts_refused(overrides, key, capsys):
    assert main(ONE_GPU + overrides + ["dry_run=true"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    # every problem on its own line, the first names the key; nothing but config errors
    assert all(line.startswith("rlcore: config error: ") for line in err), err
    assert err[0].startswith(f"rlcore: config error: {key}"), err[0]


def test_memory_line_gives_the_numbers(capsys):
    assert main(ONE_GPU + SHAPE_4B + ["trainer.micro_batch_tokens=16384", "dry_run=true"]) == 2
    line = capsys.readouterr().err.strip()
    assert "139.8 GiB GPU" in line and "activations at trainer.micro_batch_tokens=16384" in line
    assert "do not fit" in line


def test_refused_before_ray_on_this_machine(capsys):
    """Without dry_run the same checks run against this machine (no GPU here) before Ray."""
    import sys

    assert main(VLLM_1_1 + ["placement=colocated"]) == 2
    assert capsys.readouterr().err.strip().startswith("rlcore: config error: trainer.gpus_per_rank")
    assert "ray" not in sys.modules or not sys.modules["ray"].is_initialized()


def test_a_gpu_recipe_planned_without_gpus_names_the_key_and_how_to_plan_offline(capsys):
    """A colocated bundle that finds no GPU is the trainer's key (it was reported under
    teacher.gpus_per_actor), and the line says how to plan for a GPU machine from here."""
    assert main(VLLM_1_1 + ["cluster.num_gpus=0", "placement=colocated", "dry_run=true"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith("rlcore: config error: trainer.gpus_per_rank: a colocated bundle"), err
    assert any("dry_run=true cluster.nodes=1 cluster.gpus_per_node=1" in line for line in err), err
