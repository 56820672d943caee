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
from rlcore.config import RunConfig
from rlcore.engine.slots import RequestLimits
from rlcore.plan.node_fit import group_selector
from rlcore.plan.pd import rollout_pools, rollout_roles
from rlcore.plan.placement import colocated_shares
from rlcore.report.events import event

log = logging.getLogger("rlcore")


def bundle(cpus: float, gpus: float) -> dict[str, float]:
    b = {"CPU": float(cpus)}
    if gpus > 0:
        b["GPU"] = float(gpus)
    return b


def colocated_bundles(cfg: RunConfig) -> list[dict[str, float]]:
    """One bundle per GPU: trainer rank i and rollout actor i share it; a GPU teacher takes the
    rest of the GPU from its own group (`rlcore.plan.placement.colocated_shares`)."""
    t, r = cfg.trainer, cfg.rollout
    return [bundle(t.cpus_per_rank + r.cpus_per_actor, colocated_shares(cfg)[0]) for _ in range(t.world_size)]


def trainer_bundles(cfg: RunConfig) -> list[dict[str, float]]:
    t = cfg.trainer
    return [bundle(t.cpus_per_rank, t.gpus_per_rank) for _ in range(t.world_size)]


def rollout_bundles(cfg: RunConfig) -> list[dict[str, float]]:
    """One bundle per rollout actor, pool by pool (`rlcore.plan.pd.rollout_pools`: the decode
    pool, then the prefill pool, when disaggregated)."""
    return [bundle(cpus, gpus) for _, n, cpus, gpus in rollout_pools(cfg) for _ in range(n)]


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
    cfg: RunConfig, trainer: bool = True, rollout: bool = True
) -> tuple[PlacementGroup | None, PlacementGroup | None]:
    """Reserve the placement groups (PACK: ranks of one group close together; each bundle only on
    nodes with its group's labels, `cluster.trainer_node_labels` / `cluster.rollout_node_labels`)
    and wait for them with a timeout: (trainer or colocated group, rollout group), the same
    object twice when colocated, None for a group left out. Starts no actor."""
    shared = cfg.current_placement() == "colocated" and trainer and rollout

    def group(bundles: list[dict[str, float]], kind: str) -> PlacementGroup:
        selector = group_selector(cfg, kind)
        return placement_group(
            bundles,
            strategy="PACK",
            name=f"rlcore-{kind}",
            bundle_label_selector=[selector] * len(bundles) if selector else None,
        )

    if shared:
        trainer_pg = rollout_pg = group(colocated_bundles(cfg), "colocated")
    else:
        trainer_pg = group(trainer_bundles(cfg), "trainer") if trainer else None
        rollout_pg = group(rollout_bundles(cfg), "rollout") if rollout else None
    pgs = list({id(pg): pg for pg in (trainer_pg, rollout_pg) if pg is not None}.values())
    timeout = cfg.cluster.placement_timeout_s
    refs = [pg.ready() for pg in pgs]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=min(PLACEMENT_NOTICE_S, timeout))
    if len(ready) < len(pgs) and timeout > PLACEMENT_NOTICE_S:
        log.warning(
            "placement: waiting for the cluster to schedule the placement groups (trainer %s, rollout %s); "
            "up to %.0fs more (cluster.placement_timeout_s)",
            trainer_bundles(cfg) if trainer else "-",
            rollout_bundles(cfg) if rollout else "-",
            timeout - PLACEMENT_NOTICE_S,
        )
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout - PLACEMENT_NOTICE_S)
    if len(ready) < len(pgs):
        for pg in pgs:
            remove_placement_group(pg)
        raise TimeoutError(
            f"cluster: placement groups not scheduled within {timeout:.0f}s "
            f"(trainer {trainer_bundles(cfg)}, rollout {rollout_bundles(cfg)}); "
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


def place(cfg: RunConfig, trainer: bool = True, rollout: bool = True) -> Groups:
    """Reserve the placement groups (`reserve`) and start one actor per bundle. `mode=sft`
    needs no rollout group and `mode=eval` no trainer group: pass False to leave one out
    (`trainers` None, `rollouts` empty). Colocated placement: one group, 'rlcore-colocated',
    whose bundle i holds trainer rank i and rollout actor i, each taking half of the bundle's
    GPU (`colocated_shares`)."""
    shared = cfg.current_placement() == "colocated" and trainer and rollout
    trainer_pg, rollout_pg = reserve(cfg, trainer, rollout)
    t, r = cfg.trainer, cfg.rollout
    trainer_gpus, rollout_gpus = (colocated_shares(cfg)[1],) * 2 if shared else (t.gpus_per_rank, r.gpus_per_actor)
    trainers = TrainerGroup(cfg, trainer_pg, trainer_gpus) if trainer else None
    rollout_cls = remote_class(RolloutWorker)  # the config travels in the runtime_env (`actors.actor_config`)
    roles = rollout_roles(cfg) if rollout else []
    # a disaggregated group's prefill actors first: each decode actor's router is given their handles
    prefill = [i for i, role in enumerate(roles) if role == "prefill"]
    # a prefill actor serves every decode actor's generate slots at once, plus the control calls
    limits = RequestLimits.of(r)
    gpus_of = {"prefill": r.pd.prefill_gpus_per_actor}
    cpus_of = {"prefill": r.pd.prefill_cpus_per_actor}

    # decode actors find the prefill actors by name: a constructor argument holding actor handles
    # lives in the object store, and a restart must never depend on an object Ray may have freed
    names = {i: f"rlcore-prefill-{uuid.uuid4().hex[:8]}-{i}" for i in prefill}

    def start(i: int, *args):
        role = roles[i]
        return rollout_cls.options(
            name=names.get(i),
            num_cpus=cpus_of.get(role, r.cpus_per_actor),
            num_gpus=gpus_of.get(role, rollout_gpus),
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
