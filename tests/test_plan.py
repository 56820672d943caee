"""The qwen30b_swe dry run: a correct plan for the described cluster, impossible layouts refused."""

import pytest

from rlcore.plan.layout import make_plan
from rlcore.plan.compose import compose
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


@pytest.mark.parametrize("overrides,key", [
    (["trainer.ep=3", "trainer.world_size=12", "trainer.dp=6"], "trainer.ep"),
    (["cluster.nodes=3"], "cluster.nodes"),
    (["rollout.gpus_per_actor=16", "rollout.vllm.tensor_parallel_size=16"], "rollout.gpus_per_actor"),
    (["trainer.cp=3", "trainer.dp=4", "trainer.world_size=12", "trainer.ep=4"], "trainer.cp"),
])
def test_impossible_layouts_refused(overrides, key, capsys):
    assert main(["+recipe=qwen30b_swe", "dry_run=true", *overrides]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(f"rlcore: config error: {key}")
