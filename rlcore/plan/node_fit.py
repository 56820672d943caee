"""Node labels for the placement groups, and the run's bundles laid on a live cluster's nodes.

`cluster.trainer_node_labels` / `cluster.rollout_node_labels` (`{key: value, ...}`) restrict a
group's bundles to the nodes started with those labels (`ray start --labels key=value`); Ray's scheduler
enforces it through each bundle's label selector (`actors.groups.reserve`). This module checks
the labels' syntax before Ray starts (`label_problems`), and, once connected, whether the bundles
fit the alive nodes at all (`fit_problems`): a group that no node can hold is refused at once
instead of waiting `cluster.placement_timeout_s` for a placement that cannot happen. Pure: no Ray.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from rlcore.config import ClusterConfig, RunConfig

# Ray's label syntax (Kubernetes' too): an optional DNS prefix and '/', then a name of at most 63
# characters, alphanumeric at both ends; values likewise (ray._private.label_utils)
_NAME = r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
_KEY = re.compile(rf"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?{_NAME}$")
_VALUE = re.compile(rf"^{_NAME}$")
RESERVED_PREFIX = "ray.io/"

LABEL_KEYS = {
    "trainer": "cluster.trainer_node_labels",
    "rollout": "cluster.rollout_node_labels",
    "colocated": "cluster.trainer_node_labels",
}


@dataclass
class NodeCapacity:
    """One alive node as Ray reports it: its id, total CPUs and GPUs, and labels."""

    node_id: str
    cpus: float
    gpus: float
    labels: dict[str, str] = field(default_factory=dict)


def label_error(key: str, value: str) -> str | None:
    """What is wrong with one label `key: value` (Ray's syntax), None when nothing."""
    if not _KEY.match(key):
        return (
            f"{key!r} is not a Ray label key ([prefix/]name, name of at most 63 characters: letters, "
            f"digits, '-', '_', '.', alphanumeric at both ends)"
        )
    if key.startswith(RESERVED_PREFIX):
        return f"{key!r}: the prefix {RESERVED_PREFIX!r} is Ray's own"
    if not _VALUE.match(str(value)):
        return (
            f"{key}: {value!r} is not a Ray label value (at most 63 characters: letters, digits, '-', '_', "
            f"'.', alphanumeric at both ends)"
        )
    return None


def label_problems(cfg: RunConfig) -> list[tuple[str, str]]:
    """Syntax of the labels, and colocated placement (one group for both sides) given different
    labels for the two sides."""
    c = cfg.cluster
    out = []
    for key, labels in (
        ("cluster.trainer_node_labels", c.trainer_node_labels),
        ("cluster.rollout_node_labels", c.rollout_node_labels),
    ):
        for k, v in labels.items():
            why = label_error(str(k), str(v))
            if why:
                out.append((f"{key}.{k}", why))
    if (
        cfg.current_placement() == "colocated"
        and c.rollout_node_labels
        and c.rollout_node_labels != c.trainer_node_labels
    ):
        out.append(
            (
                "cluster.rollout_node_labels",
                f"colocated placement puts trainer rank i and engine i in one "
                f"bundle: it follows cluster.trainer_node_labels ({dict(c.trainer_node_labels)}); leave "
                f"cluster.rollout_node_labels empty or equal, got {dict(c.rollout_node_labels)}",
            )
        )
    return out


def group_selector(cluster: ClusterConfig, group: str) -> dict[str, str] | None:
    """The label selector of a group's bundles ({key: value}), None for any node. `group`:
    trainer, rollout or colocated (which follows the trainer's labels)."""
    labels = cluster.rollout_node_labels if group == "rollout" else cluster.trainer_node_labels
    return {str(k): str(v) for k, v in labels.items()} or None


def fit_problems(cluster: ClusterConfig, bundles: list, nodes: list[NodeCapacity]) -> list[tuple[str, str]]:
    """Lay `bundles` (`rlcore.plan.Bundle`: group, cpus, gpus; trainer first, as Ray is asked)
    first-fit on `nodes`, each bundle only on nodes matching its group's label. One problem per
    group that does not fit, naming its label key when a label restricts it: no node carries the
    label, or the labelled nodes are too small. First fit can refuse a layout a cleverer packing
    would find; Ray's own scheduler is greedy too."""
    free = {n.node_id: [n.cpus, n.gpus] for n in nodes}
    out: list[tuple[str, str]] = []
    refused: set[str] = set()
    for b in bundles:
        if b.group in refused:
            continue
        selector = group_selector(cluster, b.group) or {}
        matching = [n for n in nodes if all(n.labels.get(k) == v for k, v in selector.items())]
        label = ",".join(f"{k}={v}" for k, v in selector.items())
        key = LABEL_KEYS.get(b.group, "cluster.address") if selector else "cluster.address"
        if not matching:
            seen = sorted({f"{k}={v}" for n in nodes for k, v in n.labels.items() if not k.startswith(RESERVED_PREFIX)})
            out.append(
                (
                    key,
                    f"no alive node has the label {label} the {b.group} group asks for (the nodes' labels: "
                    f"{', '.join(seen) or 'none'}); start such nodes with `ray start --labels {label}` "
                    f"(or `python -m launch.local_cluster start --labels ...`) and pass cluster.address",
                )
            )
            refused.add(b.group)
            continue
        for n in matching:
            cpu, gpu = free[n.node_id]
            if b.cpus <= cpu + 1e-9 and b.gpus <= gpu + 1e-9:
                free[n.node_id] = [cpu - b.cpus, gpu - b.gpus]
                break
        else:
            where = (
                f"the {len(matching)} node(s) labelled {label}" if selector else f"the cluster's {len(nodes)} node(s)"
            )
            total = ", ".join(f"{{CPU: {n.cpus:g}, GPU: {n.gpus:g}}}" for n in matching)
            n_group = sum(1 for x in bundles if x.group == b.group)
            out.append(
                (
                    key,
                    f"the {b.group} group's {n_group} bundle(s) of {{CPU: {b.cpus:g}, GPU: {b.gpus:g}}} "
                    f"do not fit on {where} ({total}) beside the groups placed before it",
                )
            )
            refused.add(b.group)
    return out


def capacity_gone(cluster: ClusterConfig, bundles: list, nodes: list[NodeCapacity]) -> str | None:
    """Why no alive node can host `bundles` (one group's bundles to place again: a trainer group
    restarting, one rollout actor's bundle) even on an empty cluster, or None when the alive nodes
    could: the label the group asks for is on no alive node, or the labelled nodes are too
    small. Optimistic (what other groups hold now is not counted), so it speaks only when a node
    must join for the wait to end: a node lost with no replacement."""
    found = fit_problems(cluster, bundles, nodes)
    return found[0][1] if found else None
