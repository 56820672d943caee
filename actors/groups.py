"""Placement: one placement group for the trainer ranks, one for the rollout actors (one shared
group when colocated); the trainer group (`actors.trainer_group`) and the rollout actors start
in their bundles."""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass

import ray
from ray.util.placement_group import (
    PlacementGroup,
    placement_group,
    placement_group_table,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.actor_config import config_env, remote_class
from actors.rollout import RolloutWorker
from actors.trainer_group import TrainerGroup
from rlcore.engine.slots import RequestLimits
from rlcore.plan.layout import Bundle, Plan
from rlcore.plan.node_fit import group_selector
from rlcore.report.events import event

log = logging.getLogger("rlcore")


def bundle(cpus: float, gpus: float) -> dict[str, float]:
    b = {"CPU": float(cpus)}
    if gpus > 0:
        b["GPU"] = float(gpus)
    return b


def specs(bundles: list[Bundle]) -> list[dict[str, float]]:
    """The plan's bundles (`rlcore.plan.layout.Bundle`) as Ray's resource dicts."""
    return [bundle(b.cpus, b.gpus) for b in bundles]


@dataclass
class Groups:
    """What `place` started: the placement groups, the trainer group (None without one) and the
    rollout actors' handles (empty without them)."""

    trainer_pg: PlacementGroup | None
    rollout_pg: PlacementGroup | None
    trainers: TrainerGroup | None
    rollouts: list

    def shutdown(self) -> None:
        """Close the trainers' process groups (best effort: this runs on the way out, also after a
        fault), then kill every actor and free both placement groups."""
        if self.trainers is not None:
            self.trainers.shutdown()
        self.remove()

    def remove(self) -> None:
        if self.trainers is not None:
            self.trainers.kill()
        for a in self.rollouts:
            ray.kill(a, no_restart=True)
        pgs = [self.trainer_pg] + ([self.rollout_pg] if self.rollout_pg is not self.trainer_pg else [])
        for pg in pgs:
            if pg is not None:
                remove_placement_group(pg)


PLACEMENT_NOTICE_S = 5.0
"""A placement still waiting after this long says so in one line."""


def reserve(
    plan: Plan, trainer: bool = True, rollout: bool = True
) -> tuple[PlacementGroup | None, PlacementGroup | None]:
    """Reserve the plan's placement groups (PACK: ranks of one group close together; each bundle
    only on nodes with its group's labels, `cluster.trainer_node_labels` / `cluster.rollout_node_labels`)
    and wait for them with a timeout: (trainer or colocated group, rollout group), the same
    object twice when colocated, None for a group left out. Starts no actor."""
    cfg = plan.config
    shared = plan.colocated and trainer and rollout
    trainer_specs, rollout_specs = specs(plan.trainer), specs(plan.rollout)

    def group(bundles: list[dict[str, float]], kind: str) -> PlacementGroup:
        selector = group_selector(cfg.cluster, kind)
        return placement_group(
            bundles,
            strategy="PACK",
            name=f"rlcore-{kind}",
            bundle_label_selector=[selector] * len(bundles) if selector else None,
        )

    if shared:
        trainer_pg = rollout_pg = group(trainer_specs, "colocated")
    else:
        trainer_pg = group(trainer_specs, "trainer") if trainer else None
        rollout_pg = group(rollout_specs, "rollout") if rollout else None
    pgs = list({id(pg): pg for pg in (trainer_pg, rollout_pg) if pg is not None}.values())
    timeout = cfg.cluster.placement_timeout_s
    refs = [pg.ready() for pg in pgs]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=min(PLACEMENT_NOTICE_S, timeout))
    if len(ready) < len(pgs) and timeout > PLACEMENT_NOTICE_S:
        log.warning(
            "placement: waiting for the cluster to schedule the placement groups (trainer %s, rollout %s); "
            "up to %.0fs more (cluster.placement_timeout_s)",
            trainer_specs if trainer else "-",
            rollout_specs if rollout else "-",
            timeout - PLACEMENT_NOTICE_S,
        )
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout - PLACEMENT_NOTICE_S)
    if len(ready) < len(pgs):
        for pg in pgs:
            remove_placement_group(pg)
        raise TimeoutError(
            f"cluster: placement groups not scheduled within {timeout:.0f}s "
            f"(trainer {trainer_specs}, rollout {rollout_specs}); "
            f"cluster has {ray.available_resources()}"
        )
    level = logging.INFO if multi_node() else logging.DEBUG  # one node: nothing to tell
    for name, pg in (("trainer", trainer_pg), ("rollout", rollout_pg)):
        if pg is not None and not (shared and name == "rollout"):
            log.log(
                level,
                "placement: %s group's %d bundle(s) on node(s) %s",
                "colocated" if shared else name,
                len(pg.bundle_specs),
                ", ".join(n[:8] for n in bundle_nodes(pg)),
            )
    return trainer_pg, rollout_pg


def multi_node() -> bool:
    """Whether the Ray cluster has more than one live node (where placement is news)."""
    return sum(1 for n in ray.nodes() if n["Alive"]) > 1


def bundle_nodes(pg: PlacementGroup) -> list[str]:
    """The Ray node id of each bundle of a scheduled placement group, in bundle order (Ray moves
    a dead node's bundles to another node: this is where they are now)."""
    where = placement_group_table(pg)["bundles_to_node_id"]
    return [where.get(i, "") for i in range(len(pg.bundle_specs))]


def note_moved(pg: PlacementGroup | None, before: list[str], joined: list[int], step: int | None = None) -> list[str]:
    """After restarted rollout actors `joined`: one line (and timeline event, after `step` steps)
    for each whose bundle Ray re-placed on another node (it does so when the bundle's node died);
    returns the bundles' nodes now."""
    if pg is None or not before:
        return before
    now = bundle_nodes(pg)
    for i in joined:
        if now[i] != before[i]:
            log.warning(
                "rollout actor %d's node %s died: Ray re-placed its bundle on node %s, where it runs now",
                i,
                before[i][:8],
                now[i][:8],
                extra=event("rollout_moved", actor=i, node_before=before[i][:8], node=now[i][:8], step=step),
            )
    return now


def place(plan: Plan, trainer: bool = True, rollout: bool = True) -> Groups:
    """Reserve the plan's placement groups (`reserve`) and start one actor per bundle. `mode=sft`
    needs no rollout group and `mode=eval` no trainer group: pass False to leave one out
    (`trainers` None, `rollouts` empty). Colocated placement: one group, 'rlcore-colocated',
    whose bundle i holds trainer rank i and rollout actor i, each taking `plan.colocated_share`
    of the bundle's GPU."""
    cfg = plan.config
    shared = plan.colocated and trainer and rollout
    trainer_pg, rollout_pg = reserve(plan, trainer, rollout)
    r = cfg.rollout
    trainers = (
        TrainerGroup(cfg, trainer_pg, plan.colocated_share if shared else plan.trainer[0].gpus, plan.trainer)
        if trainer
        else None
    )
    rollout_cls = remote_class(RolloutWorker)  # the config travels in the runtime_env (`actors.actor_config`)
    roles = plan.roles if rollout else []
    # a disaggregated group's prefill actors first: each decode actor's router is given their handles
    prefill = [i for i, role in enumerate(roles) if role == "prefill"]
    # a prefill actor serves every decode actor's generate slots at once, plus the control calls
    limits = RequestLimits.of(r)

    def resources(i: int) -> tuple[float, float]:
        """(CPUs, GPUs) of rollout actor i: its bundle's, or its share of a colocated one."""
        return (r.cpus_per_actor, plan.colocated_share) if shared else (plan.rollout[i].cpus, plan.rollout[i].gpus)

    # decode actors find the prefill actors by name: a constructor argument holding actor handles
    # lives in the object store, and a restart must never depend on an object Ray may have freed
    names = {i: f"rlcore-prefill-{uuid.uuid4().hex[:8]}-{i}" for i in prefill}

    def start(i: int, *args):
        role, (cpus, gpus) = roles[i], resources(i)
        return rollout_cls.options(
            name=names.get(i),
            num_cpus=cpus,
            num_gpus=gpus,
            # a weight pull must never wait behind the requests (`RequestLimits`)
            max_concurrency=(
                limits.prefill_concurrency(r.num_actors) if role == "prefill" else limits.actor_concurrency
            ),
            # a dead engine is restarted and rejoins the weight group; its requests in flight are
            # counted failed by the driver, never retried blindly on new weights
            max_restarts=r.max_restarts,
            max_task_retries=0,
            runtime_env=config_env(cfg, r.env_vars),
            scheduling_strategy=PlacementGroupSchedulingStrategy(rollout_pg, placement_group_bundle_index=i),
        ).remote(i, role, *args)

    handles = {i: start(i) for i in prefill}
    for i, role in enumerate(roles):
        if role != "prefill":
            handles[i] = (
                start(i, [names[j] for j in prefill], [f"rollout actor {j} (prefill)" for j in prefill])
                if role == "decode"
                else start(i)
            )
    rollouts = [handles[i] for i in range(len(roles))]
    return Groups(trainer_pg, rollout_pg, trainers, rollouts)
