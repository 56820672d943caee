"""The plan is made once, by `rlcore.plan`, and handed to the Ray layer: `actors/` places the
plan's bundles and reads its pools and shares, and never decides them again from the config."""

import ast
from pathlib import Path

import pytest

from rlcore.plan.compose import compose
from rlcore.plan.layout import Bundle, run_plan
from rlcore.plan.placement import resolve

ACTORS = Path(__file__).resolve().parent.parent / "actors"
DECIDERS = {
    "group_bundles",
    "rollout_pools",
    "rollout_roles",
    "colocated_shares",
    "gpu_share",
    "resolve",
    "resolve_placement",
    "resolved",
    "make_plan",
    "run_plan",
    "mesh_of",
}
"""The planner's functions that decide placement (groups, pools, shares, the resolved config):
the run calls them, the Ray layer reads their answer from the Plan."""

VLLM_1_1 = ["model=qwen3_06b_char", "rollout.engine=vllm", "trainer.gpus_per_rank=1", "rollout.gpus_per_actor=1"]
PD = [
    "placement=split",
    "rollout.engine=vllm",
    "rollout.num_actors=2",
    "rollout.gpus_per_actor=1",
    "rollout.pd.enabled=true",
    "rollout.pd.connector=nixl",
    "rollout.pd.prefill_actors=1",
    "rollout.pd.prefill_gpus_per_actor=2",
    "rollout.pd.prefill_tensor_parallel_size=2",
]


def planner_names_used(path: Path) -> list[str]:
    """The deciding names a module of `actors/` imports from `rlcore.plan` or calls."""
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("rlcore.plan"):
            found += [a.name for a in node.names if a.name in DECIDERS]
        elif isinstance(node, ast.Call):
            fn = node.func
            name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", None)
            if name in DECIDERS - {"resolve"}:  # `resolve` is also a Path method
                found.append(name)
    return found


def test_the_ray_layer_decides_no_placement():
    used = {str(p.relative_to(ACTORS.parent)): planner_names_used(p) for p in sorted(ACTORS.glob("*.py"))}
    assert {p: names for p, names in used.items() if names} == {}


def test_the_check_sees_a_decision_made_in_actors(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text(
        "from rlcore.plan.pd import rollout_roles\n\ndef f(cfg):\n    return layout.group_bundles(cfg)\n"
    )
    assert planner_names_used(planted) == ["rollout_roles", "group_bundles"]


def test_run_plan_carries_pools_shares_and_config():
    pd = run_plan(compose(PD))
    assert pd.roles == ["decode", "decode", "prefill"] and not pd.colocated and pd.colocated_share == 0.0
    assert [(b.cpus, b.gpus) for b in pd.rollout] == [(1, 1), (1, 1), (1, 2)]
    colocated = run_plan(resolve(compose(VLLM_1_1 + ["trainer.world_size=2", "rollout.num_actors=2"]), 2, None))
    assert colocated.colocated and colocated.rollout == [] and colocated.roles == ["rollout", "rollout"]
    assert colocated.colocated_share == 0.5 and [b.gpus for b in colocated.trainer] == [1.0, 1.0]
    assert colocated.mesh == {"world": 2, "dp": 2, "cp": 1, "ep": 1} and colocated.config.placed == "colocated"
    assert run_plan(compose(["mode=sft"])).teacher == []


def test_reserve_asks_ray_for_the_plans_bundles(monkeypatch):
    """`actors.groups.reserve` takes the bundles of the Plan it is handed, not the config's: a
    plan whose bundles no config gives is what reaches Ray's `placement_group`."""
    import actors.groups as groups

    asked = []

    class Asked(Exception):
        pass

    def placement_group(bundles, strategy, name, bundle_label_selector):
        asked.append((name, bundles))
        raise Asked

    monkeypatch.setattr(groups, "placement_group", placement_group)
    plan = run_plan(compose(PD))
    plan.rollout[2] = Bundle("rollout", 2, 3.0, 0.25, role="prefill")
    with pytest.raises(Asked):
        groups.reserve(plan, trainer=False)
    assert asked == [
        ("rlcore-rollout", [{"CPU": 1.0, "GPU": 1.0}, {"CPU": 1.0, "GPU": 1.0}, {"CPU": 3.0, "GPU": 0.25}])
    ]
