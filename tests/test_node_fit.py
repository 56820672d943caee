"""Placement by node label, before Ray: label syntax (one line naming the key), the run's bundles
laid on a cluster's nodes (a group no node can hold is refused naming its label key), and the
local-cluster launcher's own input checks."""

import pytest

from launch.local_cluster import ClusterError, parse_specs
from launch.placement_check import compare
from rlcore.plan.compose import compose
from rlcore.plan.layout import Bundle, group_bundles
from rlcore.plan.node_fit import NodeCapacity, fit_problems, group_selector, label_problems
from rlcore.plan.validate import placed_bundles
from rlcore.run import main

LABELS = ["cluster.trainer_node_labels.rlcore-group=trainer", "cluster.rollout_node_labels.rlcore-group=rollout"]


def nodes(*specs):
    return [NodeCapacity(f"n{i}", cpus, gpus, labels) for i, (cpus, gpus, labels) in enumerate(specs)]


def test_labels_compose_key_by_key_or_whole_and_become_selectors():
    cfg = compose(LABELS)
    assert group_selector(cfg.cluster, "trainer") == {"rlcore-group": "trainer"}
    assert group_selector(cfg.cluster, "rollout") == {"rlcore-group": "rollout"}
    assert group_selector(cfg.cluster, "colocated") == {"rlcore-group": "trainer"}
    whole = compose(["cluster.rollout_node_labels={rlcore-group:rollout,zone:b}"])
    assert group_selector(whole.cluster, "rollout") == {"rlcore-group": "rollout", "zone": "b"}
    assert group_selector(whole.cluster, "trainer") is None
    assert label_problems(cfg) == []


@pytest.mark.parametrize(
    "override,key",
    [
        ("cluster.trainer_node_labels.rlcore-group=-bad", "cluster.trainer_node_labels.rlcore-group"),
        ("cluster.rollout_node_labels={ray.io/node-id:x}", "cluster.rollout_node_labels.ray.io/node-id"),
        ("cluster.rollout_node_labels={_group:x}", "cluster.rollout_node_labels._group"),
    ],
)
def test_a_bad_label_is_one_line_naming_it_before_ray(override, key, capsys):
    import sys

    assert main([override, "steps=1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith(f"rlcore: config error: {key}: "), err
    assert "ray" not in sys.modules or not sys.modules["ray"].is_initialized()


def test_colocated_placement_refuses_two_different_labels():
    cfg = compose(LABELS + ["placement=colocated"])
    assert [k for k, _ in label_problems(cfg)] == ["cluster.rollout_node_labels"]


def test_bundles_fit_labelled_nodes_or_the_group_is_refused_naming_its_key():
    cfg = compose(LABELS)
    bundles = placed_bundles(cfg)
    assert [b.group for b in bundles] == ["trainer", "rollout"]
    good = nodes(
        (1, 0, {"rlcore-group": "driver"}), (1, 0, {"rlcore-group": "trainer"}), (2, 0, {"rlcore-group": "rollout"})
    )
    assert fit_problems(cfg.cluster, bundles, good) == []
    missing = fit_problems(cfg.cluster, bundles, good[:2])
    assert [k for k, _ in missing] == ["cluster.rollout_node_labels"]
    assert "no alive node has the label rlcore-group=rollout" in missing[0][1]
    big = compose(LABELS + ["trainer.cpus_per_rank=2"])
    small = fit_problems(big.cluster, placed_bundles(big), good)
    assert [k for k, _ in small] == ["cluster.trainer_node_labels"] and "do not fit on the 1 node(s)" in small[0][1]
    # without labels every node counts, and the bundles of earlier groups take their room first
    plain = compose(["trainer.cpus_per_rank=2", "rollout.cpus_per_actor=1"])
    assert fit_problems(plain.cluster, placed_bundles(plain), nodes((2, 0, {}))) == [
        (
            "cluster.address",
            "the rollout group's 1 bundle(s) of {CPU: 1, GPU: 0} do not fit on the cluster's 1 "
            "node(s) ({CPU: 2, GPU: 0}) beside the groups placed before it",
        )
    ]
    assert placed_bundles(compose(["mode=sft"])) == group_bundles(compose(["mode=sft"]))[0]


def test_qwen30b_swe_fits_four_8_gpu_nodes_and_not_three():
    cfg = compose(["+recipe=qwen30b_swe"])
    four = nodes(*[(96, 8, {})] * 4)
    assert fit_problems(cfg.cluster, placed_bundles(cfg), four) == []
    assert fit_problems(cfg.cluster, placed_bundles(cfg), four[:3])[0][0] == "cluster.address"


def test_compare_maps_plan_nodes_to_ray_nodes_one_to_one():
    planned = [Bundle("trainer", i, 1, 1, node=i // 2) for i in range(4)]
    assert compare(planned, ["a", "a", "b", "b"]) == []
    assert compare(planned, ["a", "b", "b", "b"]) == [
        "plan node 0's bundles landed on 2 Ray nodes (a, b)",
        "Ray node b holds bundles of plan nodes [0, 1]",
    ]


@pytest.mark.parametrize(
    "args,message",
    [
        ((3, "1,2", "0", "", ""), "--cpus '1,2': give one value or 3 (one per node), got 2"),
        ((2, "1", "x", "", ""), "--gpus 'x': 'x' is not a whole number >= 0"),
        ((2, "1", "0", "", "a=b;c"), "--labels 'a=b;c': 'c' is not KEY=VALUE"),
        ((0, "1", "0", "", ""), "--nodes must be at least 1"),
    ],
)
def test_local_cluster_bad_input_names_the_flag(args, message):
    with pytest.raises(ClusterError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        parse_specs(*args)


def test_local_cluster_specs_per_node():
    specs = parse_specs(
        3, "1,2,2", "0,8,8", ";accel=1;", "rlcore-group=driver;rlcore-group=trainer;rlcore-group=rollout"
    )
    assert [(s.cpus, s.gpus, s.resources, s.labels["rlcore-group"]) for s in specs] == [
        (1, 0, {}, "driver"),
        (2, 8, {"accel": 1.0}, "trainer"),
        (2, 8, {}, "rollout"),
    ]


def test_capacity_gone_names_the_label_no_alive_node_has_and_a_group_too_big_for_the_nodes_left():
    """Ray-free: the decision behind a restart's 'no alive node can host the group' line."""
    from rlcore.plan.node_fit import capacity_gone

    cfg = compose(LABELS)
    trainer, rollout, _ = group_bundles(cfg)
    left = [NodeCapacity("a", 4, 0, {"rlcore-group": "rollout"})]  # the trainer's node is lost
    why = capacity_gone(cfg.cluster, trainer, left)
    assert why and why.startswith("no alive node has the label rlcore-group=trainer the trainer group asks for")
    assert capacity_gone(cfg.cluster, rollout[:1], left) is None  # the rollout side still has its node
    small = [NodeCapacity("b", 0.5, 0, {"rlcore-group": "trainer"}), *left]
    assert "do not fit on the 1 node(s) labelled rlcore-group=trainer" in capacity_gone(cfg.cluster, trainer, small)
    assert capacity_gone(cfg.cluster, trainer, [NodeCapacity("c", 8, 0, {"rlcore-group": "trainer"}), *left]) is None
