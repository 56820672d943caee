"""Place a run's groups on a live Ray cluster with Ray's own scheduler, without starting an actor,
and check every bundle landed where the dry run's plan says.

    python -m launch.placement_check cluster.address=HOST:6379 +recipe=qwen30b_swe

The same overrides as ``python -m rlcore.run``. The plan (``rlcore.plan.make_plan``, what
``dry_run=true`` prints) is checked first, then the live nodes (``rlcore.plan.node_fit``): an
impossible layout is refused (exit 2) before any placement group exists. Then the placement
groups are reserved exactly as a run reserves them (``actors.groups.reserve``), read back
(`placement_group_table`), compared with the plan, and removed. The plan's nodes are numbered;
Ray's have ids: the check is that one plan node's bundles share one Ray node and two plan nodes
never share one. Nothing CUDA starts, so a cluster whose nodes only declare GPUs
(``ray start --num-gpus=8`` on a CPU machine) checks a GPU layout.

Exit: 0 every bundle where planned, 1 a bundle elsewhere (each printed), 2 refused before placing.
"""

from __future__ import annotations

import sys
from collections import defaultdict
from typing import Optional, Sequence

EXIT_MISPLACED = 1
EXIT_REFUSED = 2


def compare(planned: list, placed: list[str]) -> list[str]:
    """Mismatches between the plan's bundles (`rlcore.plan.Bundle`, node = plan node index) and
    the Ray node id each landed on, in the same order: a plan node split over Ray nodes, or a
    Ray node holding bundles of two plan nodes. Empty when the placement matches the plan."""
    ray_of: dict[int, set[str]] = defaultdict(set)
    plan_of: dict[str, set[int]] = defaultdict(set)
    for b, node in zip(planned, placed):
        ray_of[b.node].add(node)
        plan_of[node].add(b.node)
    out = [
        f"plan node {n}'s bundles landed on {len(ids)} Ray nodes ({', '.join(sorted(i[:12] for i in ids))})"
        for n, ids in sorted(ray_of.items())
        if len(ids) > 1
    ]
    out += [
        f"Ray node {node[:8]} holds bundles of plan nodes {sorted(ns)}" for node, ns in plan_of.items() if len(ns) > 1
    ]
    return out


LOCAL_NODE_LABEL = "rlcore-local-node"
"""The label `launch.local_cluster` gives each node: its index there (`node 2 worker ...`)."""


def ray_node_name(node_id: str, nodes: list) -> str:
    """A Ray node: its id, and its number in `launch.local_cluster`'s list when it is one of
    its nodes (the plan's node numbers are the plan's own; `nodes`: `NodeCapacity`s)."""
    labels = next((n.labels for n in nodes if n.node_id == node_id), {}) or {}
    index = labels.get(LOCAL_NODE_LABEL)
    return node_id + (f" (local_cluster node {index})" if index is not None else "")


def main(argv: Optional[Sequence[str]] = None) -> int:
    from actors.session import live_nodes
    from rlcore.config.errors import ConfigError, raise_problems
    from rlcore.plan.compose import compose
    from rlcore.plan.layout import format_plan, make_plan
    from rlcore.plan.node_fit import fit_problems
    from rlcore.plan.validate import placed_bundles, problems
    from rlcore.report.console import report_config_error as report

    argv = list(sys.argv[1:] if argv is None else argv)
    if {"-h", "--help"} & set(argv):
        print(
            f"usage: python -m launch.placement_check cluster.address=HOST:PORT [+recipe=NAME] [key=value ...]\n\n"
            f"{__doc__.strip()}"
        )
        return 0
    try:
        cfg = compose(argv)
        raise_problems(problems(cfg))  # the config alone; this machine's disks are not the cluster's
        if not cfg.cluster.address:
            raise ConfigError("cluster.address", "give the Ray cluster to place on (cluster.address=HOST:PORT)")
        plan = make_plan(cfg)
        cfg = plan.config
        print(format_plan(cfg, plan), flush=True)
        raise_problems(plan.problems)
    except ConfigError as exc:
        return report(exc)

    import ray

    from actors.groups import bundle_nodes, reserve

    ray.init(address=cfg.cluster.address, logging_level="ERROR", log_to_driver=False)
    try:
        nodes = live_nodes()
        found = fit_problems(cfg.cluster, placed_bundles(cfg), nodes)
        if found:
            return report(ConfigError(*found[0], more=found[1:]))
        trainer_pg, rollout_pg = reserve(plan, trainer=cfg.mode != "eval", rollout=cfg.mode != "sft")
        try:
            groups = [("trainer", plan.trainer, trainer_pg)]
            if rollout_pg is not None and rollout_pg is not trainer_pg:
                groups.append(("rollout", plan.rollout, rollout_pg))
            planned, placed = [], []
            for name, bundles, pg in groups:
                where = bundle_nodes(pg)
                planned += bundles
                placed += where
                for b, node in zip(bundles, where):
                    pool = f" ({b.role})" if getattr(b, "role", "rollout") not in ("rollout", name) else ""
                    print(f"{name} bundle {b.index}{pool}: plan node {b.node} -> Ray node {ray_node_name(node, nodes)}")
        finally:
            from ray.util.placement_group import remove_placement_group

            for pg in {id(p): p for p in (trainer_pg, rollout_pg) if p is not None}.values():
                remove_placement_group(pg)
        wrong = compare(planned, placed)
        for line in wrong:
            print(f"MISPLACED: {line}")
        if not wrong:
            print(
                f"placement check: all {len(placed)} bundles on the nodes the plan gives ({len(set(placed))} Ray nodes)"
            )
        return EXIT_MISPLACED if wrong else 0
    finally:
        ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
