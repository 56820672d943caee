"""Placement: one placement group for the trainer ranks, one for the rollout actors (one shared
group when colocated); the trainer group (`actors.trainer_group`) and the rollout actors start
in their bundles."""

from __future__ import annotations

from dataclasses import dataclass

import ray
from ray.util.placement_group import (
    PlacementGroup,
    placement_group,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.logs import runtime_env
from actors.rollout import RolloutWorker
from actors.trainer_group import TrainerGroup
from rlcore.config import RunConfig
from rlcore.placement import colocated_shares


def bundle(cpus: float, gpus: float) -> dict[str, float]:
    b = {"CPU": float(cpus)}
    if gpus > 0:
        b["GPU"] = float(gpus)
    return b


def colocated_bundles(cfg: RunConfig) -> list[dict[str, float]]:
    """One bundle per GPU: trainer rank i and rollout actor i share it; a GPU teacher takes the
    rest of the GPU from its own group (`rlcore.placement.colocated_shares`)."""
    t, r = cfg.trainer, cfg.rollout
    return [bundle(t.cpus_per_rank + r.cpus_per_actor, colocated_shares(cfg)[0]) for _ in range(t.world_size)]


def trainer_bundles(cfg: RunConfig) -> list[dict[str, float]]:
    t = cfg.trainer
    return [bundle(t.cpus_per_rank, t.gpus_per_rank) for _ in range(t.world_size)]


def rollout_bundles(cfg: RunConfig) -> list[dict[str, float]]:
    r = cfg.rollout
    return [bundle(r.cpus_per_actor, r.gpus_per_actor) for _ in range(r.num_actors)]


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


def place(cfg: RunConfig, trainer: bool = True, rollout: bool = True) -> Groups:
    """Reserve the placement groups (PACK: ranks of one group close together), wait for them
    with a timeout, and start one actor per bundle. `mode=sft` needs no rollout group and
    `mode=eval` no trainer group: pass False to leave one out (`trainers` None, `rollouts` empty).
    Colocated placement: one group, 'rlcore-colocated', whose bundle i holds trainer rank i and
    rollout actor i, each taking half of the bundle's GPU (`colocated_shares`)."""
    shared = cfg.placement == "colocated" and trainer and rollout
    if shared:
        trainer_pg = rollout_pg = placement_group(colocated_bundles(cfg), strategy="PACK", name="rlcore-colocated")
    else:
        trainer_pg = placement_group(trainer_bundles(cfg), strategy="PACK", name="rlcore-trainer") if trainer else None
        rollout_pg = placement_group(rollout_bundles(cfg), strategy="PACK", name="rlcore-rollout") if rollout else None
    pgs = list({id(pg): pg for pg in (trainer_pg, rollout_pg) if pg is not None}.values())
    timeout = cfg.cluster.placement_timeout_s
    ready, _ = ray.wait([pg.ready() for pg in pgs], num_returns=len(pgs), timeout=timeout)
    if len(ready) < len(pgs):
        for pg in pgs:
            remove_placement_group(pg)
        raise TimeoutError(
            f"cluster: placement groups not scheduled within {timeout:.0f}s "
            f"(trainer {trainer_bundles(cfg)}, rollout {rollout_bundles(cfg)}); "
            f"cluster has {ray.available_resources()}")
    t, r = cfg.trainer, cfg.rollout
    trainer_gpus, rollout_gpus = (colocated_shares(cfg)[1],) * 2 if shared else (t.gpus_per_rank, r.gpus_per_actor)
    trainers = TrainerGroup(cfg, trainer_pg, trainer_gpus) if trainer else None
    rollout_cls = ray.remote(RolloutWorker)
    rollouts = [
        rollout_cls.options(
            num_cpus=r.cpus_per_actor, num_gpus=rollout_gpus,
            # training generate calls + one evaluation call + the weight pull + one control call
            # (busy time, RNG state): a weight pull must never wait behind generate calls
            max_concurrency=max(4, r.max_requests_per_actor + 3),
            # a dead engine is restarted and rejoins the weight group; its requests in flight are
            # counted failed by the driver, never retried blindly on new weights
            max_restarts=r.max_restarts, max_task_retries=0,
            runtime_env=runtime_env(),
            scheduling_strategy=PlacementGroupSchedulingStrategy(rollout_pg, placement_group_bundle_index=i),
        ).remote(cfg, i)
        for i in range(r.num_actors if rollout else 0)
    ]
    return Groups(trainer_pg, rollout_pg, trainers, rollouts)
