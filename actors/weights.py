"""Weights from the trainer group to the engines after every train step, and the canary that
checks them: the part of the RL driver (`actors.driver.Driver` mixes it in) that re-forms the
weight-sync group when an engine dies or comes back (`actors.membership`) and stops the run on a
stale or broken sync."""

from __future__ import annotations

import logging
import time

import ray

from actors import colocation
from actors.groups import bundle_nodes
from actors.remote import ActorDied, RunError, get
from rlcore.canary import (
    CanaryError,
    canary_limits,
    canary_prompts,
    compare_logprobs,
    task_canary_pairs,
)
from rlcore.console import one_line

log = logging.getLogger("rlcore")


class WeightSync:
    """Needs the driver's `cfg`, `groups`, `members`, `plan`, `env`, `tokenizer`, `colocated`,
    `version`, `restarts` and `_canary_pairs`."""

    def init_weight_group(self, actors: list[int] | None = None) -> None:
        """(Re)build the weight-sync group: trainer rank 0 plus the rollout actors `actors`
        (default: those serving), on a fresh rendezvous port (a group whose member died cannot be
        repaired, only replaced)."""
        g, cfg = self.groups, self.cfg
        actors = list(self.members.serving) if actors is None else actors
        timeout = cfg.rollout.weight_sync_timeout_s
        if self.colocated:
            colocation.init_ipc_group(g, self.plan, get, timeout, actors)
        elif actors:
            waddr, wport = get(g.trainers[0].address.remote(), cfg.trainer.step_timeout_s, "weight group address")
            get([tr.init_weight_group.remote(waddr, wport, self.plan, len(actors)) for tr in g.trainers]
                + [g.rollouts[i].init_weight_group.remote(waddr, wport, self.plan, None, slot, len(actors))
                   for slot, i in enumerate(actors)],
                timeout, "weight group init", [f"trainer rank {i}" for i in range(len(g.trainers))]
                + [f"rollout actor {i}" for i in actors])
        self.members.reform = False

    def admit_restarted(self) -> None:
        """Call only while no train step runs (the trainer must join the group). Restarted
        actors whose constructor has run join a re-formed group, receive the current version
        and serve again; nothing waits for one still starting (see `actors.membership`)."""
        ready = self.members.poll()
        if not ready:
            return
        self._reform_and_sync(self.version, sorted(self.members.serving + ready))
        joined = self.members.admit(ready)
        if joined:
            log.warning("rollout actor%s %s rejoined the weight group at version %d after a restart",
                        "s" if len(joined) > 1 else "", ", ".join(map(str, joined)), self.version)
            self.hooks.engines_joined()
            rollout_nodes = getattr(self, "rollout_nodes", None)
            if rollout_nodes and self.groups.rollout_pg is not None:  # a dead node's bundles moved
                now = bundle_nodes(self.groups.rollout_pg)
                for i in joined:
                    if now[i] != rollout_nodes[i]:
                        log.warning("rollout actor %d's node %s died: Ray re-placed its bundle on node %s, where it "
                                    "runs now", i, rollout_nodes[i][:8], now[i][:8])
                self.rollout_nodes = now

    def sync_weights(self, version: int, pushed: list[dict] | None = None) -> dict[str, float]:
        """Push the trainer's weights to every serving engine as `version`; returns timing
        metrics. An engine that died leaves (the group is re-formed from the others, and the
        sync retried once); nothing waits for its restart. `pushed`: the trainer ranks' results
        when their step already wrote `version` into the IPC buffers (colocated)."""
        return self._reform_and_sync(version, self.members.serving, self.members.reform, pushed)

    def _reform_and_sync(self, version: int, actors: list[int], reform: bool = True,
                         pushed: list[dict] | None = None) -> dict[str, float]:
        """(Re-form the group of `actors` and) sync `version` to them. A failure retries once
        without the engines that no longer answer; a trainer rank's death stops the run."""
        for attempt in (1, 2):
            try:
                if reform:
                    self.init_weight_group(actors)
                return self._sync(version, actors, pushed)
            except RunError as exc:
                if attempt == 2 or (isinstance(exc, ActorDied) and any(d.startswith("trainer") for d in exc.dead)):
                    raise  # only engines can be replaced
                # engines the failed call saw die need no probe: a restarting actor answers the
                # probe only once Ray has rebuilt it, so probing it costs the probe's whole 10 s
                died = [i for i in actors if isinstance(exc, ActorDied) and f"rollout actor {i}" in exc.dead]
                dead = died + self.dead_engines([i for i in actors if i not in died])
                # one line: the message may hold a remote traceback (the whole text is for a fatal error)
                what = one_line(str(exc))
                if not what.startswith("weight sync"):
                    what = f"weight sync to version {version}: {what}"
                log.warning("%s; %s", what,
                            f"rollout actor(s) {dead} left, re-forming the weight group without them" if dead
                            else "rebuilding the weight group")
                for i in dead:
                    self.engine_lost(i, float("inf"))
                actors, reform = [i for i in actors if i not in dead], True
        raise AssertionError("unreachable")

    def dead_engines(self, actors: list[int]) -> list[int]:
        """Actors of `actors` that do not answer `ready()` within 10 s (died or restarting)."""
        if not actors:
            return []
        refs = [self.groups.rollouts[i].ready.remote() for i in actors]
        ray.wait(refs, num_returns=len(refs), timeout=10.0)
        dead = []
        for i, ref in zip(actors, refs):
            try:
                ray.get(ref, timeout=0)
            except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError):
                dead.append(i)
        return dead

    def engine_lost(self, actor: int, launched_at: float) -> None:
        """A call to `actor` launched at `launched_at` failed because the actor died: it stops
        serving until Ray's restart of it has joined again (counted in `rollout_restarts`)."""
        if self.members.lost(actor, launched_at):
            self.restarts += 1
            log.warning("rollout actor %d died at version %d: %d engine(s) serve on while Ray restarts it", actor,
                        self.version, len(self.members.serving))

    def _sync(self, version: int, actors: list[int], pushed: list[dict] | None = None) -> dict[str, float]:
        g = self.groups
        start = time.perf_counter()
        timeout = self.cfg.rollout.weight_sync_timeout_s
        if not actors:  # no engine serves: the one that joins next receives the trainer's weights then
            self.version = version
            return {"sync_time_s": 0.0, "sync_gb_per_s": 0.0, "sync_send_s": 0.0}
        try:
            if self.colocated:
                out = colocation.sync_ipc(g, version, get, timeout, actors, pushed)
            else:
                out = get([tr.push_weights.remote() for tr in g.trainers]
                          + [g.rollouts[i].pull_weights.remote(version) for i in actors], timeout,
                          f"weight sync to version {version}",
                          [f"trainer rank {i}" for i in range(len(g.trainers))]
                          + [f"rollout actor {i}" for i in actors])
        except ray.exceptions.RayTaskError as exc:
            raise RunError(f"weight sync to version {version} failed: {exc}") from exc
        self.version = version
        elapsed = time.perf_counter() - start
        sent = out[0]["sync_bytes"]
        metrics = {"sync_time_s": elapsed, "sync_gb_per_s": sent / max(elapsed, 1e-9) / 1e9,
                   "sync_send_s": out[0]["sync_send_s"],
                   # the send ran inside the train step (colocated): sync_time_s is the receive alone
                   "sync_in_step": float(pushed is not None)}
        engine = out[len(g.trainers)]
        metrics.update({k: float(v) for k, v in engine.items() if k in ("sync_engine_s", "sync_worker_s")})
        metrics.update(self.check_canary(version, actors))
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

    def check_canary(self, version: int, actors: list[int]) -> dict[str, float]:
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
        engine_refs = [self.groups.rollouts[i].canary_logprobs.remote(pairs) for i in actors]
        trainer = get(trainer_refs, timeout, "canary (trainer)",
                      [f"trainer rank {i}" for i in range(len(self.groups.trainers))])[0]
        engines = get(engine_refs, timeout, "canary (engines)", [f"rollout actor {i}" for i in actors])
        worst = None
        max_gap, mean_gap = canary_limits(self.cfg)
        for i, engine in zip(actors, engines):
            try:
                res = compare_logprobs(engine, trainer, max_gap=max_gap, mean_gap=mean_gap)
            except CanaryError as exc:
                raise RunError(f"canary after sync to version {version}, rollout actor {i}: {exc}") from exc
            if worst is None or res.max_gap > worst.max_gap:
                worst = res
        return {"canary_max_gap": worst.max_gap, "canary_mean_gap": worst.mean_gap,
                "canary_time_s": time.perf_counter() - start}
