"""The qwen30b_swe dry run: a correct plan for the described cluster, impossible layouts refused."""

import pytest

from rlcore.plan.compose import compose
from rlcore.plan.layout import make_plan
from rlcore.run import main


def test_qwen30b_swe_plan():
    cfg = compose(["+recipe=qwen30b_swe"])
    plan = make_plan(cfg)
    assert plan.problems == []
    assert plan.mesh == {"world": 16, "dp": 8, "cp": 2, "ep": 8}
    assert sorted({b.node for b in plan.trainer}) == [0, 1]
    assert sorted({b.node for b in plan.rollout}) == [2, 3]
    assert all(b.gpus == 2 for b in plan.rollout) and len(plan.rollout) == 8


def test_dry_run_prints_plan_without_ray(capsys):
    import sys

    assert main(["+recipe=qwen30b_swe", "dry_run=true"]) == 0
    out = capsys.readouterr().out
    assert "dp=8 x cp=2" in out and "ep=8" in out and "8 x vllm (tensor_parallel_size=2)" in out
    assert "ray" not in sys.modules or not sys.modules["ray"].is_initialized()


@pytest.mark.parametrize(
    "overrides,key",
    [
        (["trainer.ep=3", "trainer.world_size=12", "trainer.dp=6"], "trainer.ep"),
        (["cluster.nodes=3"], "cluster.nodes"),
        (["rollout.gpus_per_actor=16", "rollout.vllm.tensor_parallel_size=16"], "rollout.gpus_per_actor"),
        (["trainer.cp=3", "trainer.dp=4", "trainer.world_size=12", "trainer.ep=4"], "trainer.cp"),
    ],
)
def test_impossible_layouts_refused(overrides, key, capsys):
    assert main(["+recipe=qwen30b_swe", "dry_run=true", *overrides]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(f"rlcore: config error: {key}")


@pytest.mark.parametrize(
    "recipe,params_b,active_b,mesh",
    [
        ("qwen30b_swe", (30.4, 30.6), (3.2, 3.4), {"world": 16, "dp": 8, "cp": 2, "ep": 8}),  # Qwen3-30B-A3B
        ("glm45_air_swe", (105, 108), (11, 14), {"world": 16, "dp": 8, "cp": 2, "ep": 8}),  # GLM-4.5-Air: 106B-A12B
        ("qwen35_moe_swe", (34, 36), (3, 3.6), {"world": 16, "dp": 16, "cp": 1, "ep": 8}),  # Qwen3.5-35B-A3B (text)
    ],
)
def test_real_size_moe_recipes_plan_and_build_offline(recipe, params_b, active_b, mesh, capsys):
    """The MoE recipes on qwen30b_swe's 4 x 8-GPU layout: the plan has no problem and fits the four
    nodes (not three); the arch builds a transformers config offline whose model (on the meta
    device) has the size the recipe names, as the planner counts it."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from rlcore.plan.memory import param_count
    from rlcore.plan.node_fit import NodeCapacity, fit_problems
    from rlcore.plan.validate import placed_bundles, problems

    cfg = compose([f"+recipe={recipe}"])
    plan = make_plan(cfg)
    assert plan.problems == [] and plan.mesh == mesh and problems(cfg) == []
    four = [NodeCapacity(f"n{i}", 96, 8, {}) for i in range(4)]
    assert fit_problems(cfg.cluster, placed_bundles(cfg), four) == []
    assert fit_problems(cfg.cluster, placed_bundles(cfg), four[:3])[0][0] == "cluster.address"
    arch = dict(cfg.model.arch)
    config = AutoConfig.for_model(arch.pop("model_type"), **arch)
    config = getattr(config, "text_config", config)  # the language model (a VLM's text side)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    n = sum(p.numel() for p in model.parameters())
    assert params_b[0] * 1e9 < n < params_b[1] * 1e9, n
    assert abs(param_count(cfg) - n) < 0.005 * n  # the planner's count of the same model
    active = param_count(cfg, active=True)
    assert active_b[0] * 1e9 < active < active_b[1] * 1e9, active
    assert main([f"+recipe={recipe}", "dry_run=true"]) == 0  # the plan says both
    assert f"({n / 1e9:.1f}B parameters, {active / 1e9:.1f}B active)" in capsys.readouterr().out
