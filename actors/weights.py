"""Weights from the trainer group to the engines after every train step, and the canary that
checks them: the part of the RL driver (`actors.driver.Driver` mixes it in) that rebuilds the
weight-sync group when an engine was replaced and stops the run on a stale or broken sync."""

from __future__ import annotations

import logging
import time

import ray

from actors import colocation
from actors.remote import ActorDied, RunError, get, wait_ready
from rlcore.canary import (
    CanaryError,
    canary_limits,
    canary_prompts,
    compare_logprobs,
    task_canary_pairs,
)

log = logging.getLogger("rlcore")


class WeightSync:
    """Needs the driver's `cfg`, `groups`, `plan`, `env`, `tokenizer`, `colocated`, `version`,
    `restarts`, `rejoin_needed` and `_canary_pairs`."""

    def init_weight_group(self) -> None:
        """(Re)build the weight-sync group: trainer rank 0 plus every rollout actor, on a fresh
        rendezvous port (a group whose member died cannot be repaired, only replaced)."""
        g, cfg = self.groups, self.cfg
        wait_ready(g.rollouts, cfg.rollout.generate_timeout_s)
        if self.colocated:
            colocation.init_ipc_group(g, self.plan, get, cfg.rollout.weight_sync_timeout_s)
            self.rejoin_needed = False
            return
        waddr, wport = get(g.trainers[0].address.remote(), cfg.trainer.step_timeout_s, "weight group address")
        get([tr.init_weight_group.remote(waddr, wport, self.plan) for tr in g.trainers]
            + [r.init_weight_group.remote(waddr, wport, self.plan) for r in g.rollouts],
            cfg.rollout.weight_sync_timeout_s, "weight group init")
        self.rejoin_needed = False

    def rejoin(self, version: int) -> dict[str, float]:
        """After a rollout actor died (Ray restarts it) or a sync failed: rebuild the weight group
        and give every engine the trainer's weights as `version` before it serves again."""
        self.restarts += 1
        self.init_weight_group()
        return self._sync(version)

    def sync_weights(self, version: int) -> dict[str, float]:
        """Push the trainer's weights to every engine as `version`; returns timing metrics. A
        sync that fails (a rollout actor died, a broken group) is retried once on a rebuilt group."""
        try:
            return self._sync(version)
        except RunError as exc:
            if isinstance(exc, ActorDied) and any(d.startswith("trainer") for d in exc.dead):
                raise  # only engines can be replaced; a trainer rank's death stops the run
            log.warning("weight sync to version %d failed (%s); rebuilding the weight group", version, exc)
            return self.rejoin(version)

    def _sync(self, version: int) -> dict[str, float]:
        g = self.groups
        start = time.perf_counter()
        timeout = self.cfg.rollout.weight_sync_timeout_s
        try:
            if self.colocated:
                out = colocation.sync_ipc(g, version, get, timeout)
            else:
                out = get([tr.push_weights.remote() for tr in g.trainers]
                          + [r.pull_weights.remote(version) for r in g.rollouts], timeout,
                          f"weight sync to version {version}",
                          [f"trainer rank {i}" for i in range(len(g.trainers))]
                          + [f"rollout actor {i}" for i in range(len(g.rollouts))])
        except ray.exceptions.RayTaskError as exc:
            raise RunError(f"weight sync to version {version} failed: {exc}") from exc
        self.version = version
        elapsed = time.perf_counter() - start
        sent = out[0]["sync_bytes"]
        metrics = {"sync_time_s": elapsed, "sync_gb_per_s": sent / max(elapsed, 1e-9) / 1e9,
                   "sync_send_s": out[0]["sync_send_s"]}
        engine = out[len(g.trainers)] if g.rollouts else {}
        metrics.update({k: float(v) for k, v in engine.items() if k in ("sync_engine_s", "sync_worker_s")})
        metrics.update(self.check_canary(version))
        return metrics

    def canary_pairs(self) -> list[tuple[list[int], list[int]]]:
        """The canary's prompts: the environment's first eval tasks, rendered once; random ids
        only where tasks carry images (image tokens need pixel values to score)."""
        if self._canary_pairs is None:
            n = self.cfg.rollout.canary_prompts
            tasks = [] if self.env.uses_images else [self.env.make_task(i, "eval")
                                                     for i in range(min(n, self.env.eval_size))]
            pairs = task_canary_pairs(tasks, self.tokenizer) if tasks else []
            if not pairs:
                vocab_size = next(m.shape[0] for b in self.plan.buckets for m in b.metas
                                  if m.name.endswith("embed_tokens.weight"))
                pairs = canary_prompts(vocab_size, num_prompts=n, seed=self.cfg.seed + 1234)
            self._canary_pairs = pairs
        return self._canary_pairs

    def check_canary(self, version: int) -> dict[str, float]:
        """After a sync, every engine's teacher-forced logprobs on a fixed prompt set must match
        the trainer's (a stale, partial or mis-mapped sync shows as whole nats of gap)."""
        r = self.cfg.rollout
        if r.canary_prompts <= 0:
            return {}
        pairs = self.canary_pairs()
        timeout = r.weight_sync_timeout_s
        start = time.perf_counter()
        # both sides at once: the sync already finished, so each scores the same version
        trainer_refs = [tr.canary_logprobs.remote(pairs) for tr in self.groups.trainers]
        engine_refs = [a.canary_logprobs.remote(pairs) for a in self.groups.rollouts]
        trainer = get(trainer_refs, timeout, "canary (trainer)",
                      [f"trainer rank {i}" for i in range(len(self.groups.trainers))])[0]
        engines = get(engine_refs, timeout, "canary (engines)", [f"rollout actor {i}" for i in range(len(engine_refs))])
        worst = None
        max_gap, mean_gap = canary_limits(self.cfg)
        for i, engine in enumerate(engines):
            try:
                res = compare_logprobs(engine, trainer, max_gap=max_gap, mean_gap=mean_gap)
            except CanaryError as exc:
                raise RunError(f"canary after sync to version {version}, rollout actor {i}: {exc}") from exc
            if worst is None or res.max_gap > worst.max_gap:
                worst = res
        return {"canary_max_gap": worst.max_gap, "canary_mean_gap": worst.mean_gap,
                "canary_time_s": time.perf_counter() - start}
