"""The Ray driver: keeps generation going, trains on fresh groups, pushes weights, logs.

Event loop (one thread): launch generate requests while the staleness bound allows, wait for
whichever remote call finishes first, and react: a finished request fills the buffer; a full
buffer starts a train step; a finished train step starts a weight sync; a finished sync
advances the policy version and logs the step. Generation never waits for training except
where `max_off_policy_steps` says so (0 gives the synchronous schedule on the same path).
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import ray
import torch
from omegaconf import OmegaConf

from actors.groups import Groups, place
from rlcore.algo.advantages import compute_advantages, nonzero_advantage_groups
from rlcore.algo.losses import loss_normalizer
from rlcore.canary import CanaryError, canary_limits, canary_prompts, compare_logprobs
from rlcore.buffer import Accounting, RolloutBuffer
from rlcore.config import RunConfig
from rlcore.envs import make_env
from rlcore.lifecycle import StepHooks, TaskFeed
from rlcore.metrics import MetricsLogger
from rlcore.packing import pack_for_ranks
from rlcore.trainer.parallel import data_parallel_size, shards_per_rank
from rlcore.types import Group, Task
from rlcore.weight_sync import SyncPlan, TensorMeta, plan_buckets

log = logging.getLogger("rlcore")


class RunError(RuntimeError):
    """A fault that stops the run, with a message that says where."""


class ActorDied(RunError):
    """A remote call failed because its actor died; `dead` names the participants."""

    def __init__(self, message: str, dead: list[str]):
        super().__init__(message)
        self.dead = dead


@dataclass
class Request:
    actor: int
    tasks: list[Task]
    samples: int
    launched_at: float
    indices: list[int] = field(default_factory=list)
    """Train-stream index of each task (data order; put back on resume)."""
    seq: int = -1


@dataclass
class StepState:
    """What the step being trained carries from batch to log line."""

    step: int
    batch: list[Group]
    max_staleness: int
    metrics: dict[str, Any] = field(default_factory=dict)


def get(refs, timeout_s: float, what: str, names: list[str] | None = None):
    """`ray.get` with a timeout and an error that names the operation and, given `names` (one per
    ref), which participant died or failed."""
    try:
        return ray.get(refs, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError as exc:
        raise RunError(f"{what} did not finish within {timeout_s:.0f}s") from exc
    except ray.exceptions.RayActorError as exc:
        dead = failed_names(refs, names)
        raise ActorDied(f"{what} failed: {', '.join(dead) or 'an actor'} died ({exc})", dead) from exc


def failed_names(refs, names: list[str] | None) -> list[str]:
    if not names or not isinstance(refs, list):
        return []
    dead = []
    for ref, name in zip(refs, names):
        try:
            ray.get(ref, timeout=0)
        except ray.exceptions.RayActorError:
            dead.append(name)
        except ray.exceptions.RayError:
            pass
    return dead


def wait_ready(actors: list, timeout_s: float) -> None:
    """Wait until every actor answers `ready()`, riding out restarts (an actor Ray is restarting
    answers "unavailable" until its constructor has run again)."""
    deadline = time.monotonic() + timeout_s
    pending = list(actors)
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            raise RunError(f"{len(pending)} rollout actor(s) not ready within {timeout_s:.0f}s")
        still = []
        for actor in pending:
            try:
                ray.get(actor.ready.remote(), timeout=min(left, 30.0))
            except (ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError):
                still.append(actor)
            except ray.exceptions.ActorDiedError as exc:
                raise RunError(f"a rollout actor died for good (restarts exhausted): {exc}") from exc
        pending = still
        if pending:
            time.sleep(0.5)


class Driver:
    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.acct = Accounting()
        a = cfg.algo
        # launch rule below keeps at most (max_off_policy_steps + 1) batches in flight
        capacity = (a.max_off_policy_steps + 2) * a.batch_groups + cfg.rollout.num_actors * cfg.rollout.tasks_per_request
        self.buffer = RolloutBuffer(a.max_off_policy_steps, capacity, self.acct)
        self.env = make_env(cfg.env.name, dict(cfg.env.args), cfg.env.seed)
        self.feed = TaskFeed(self.env, cfg)  # the data order (train stream + put-back tasks)
        self.start_step = 0  # steps already done (a resume sets it)
        self.request_seq = 0  # generate requests launched so far
        self.hooks = StepHooks(self)  # resume, checkpoints, evaluation, data-order log
        self.version = 0  # policy version the engines serve (the trainer's optimizer steps, synced)
        self.pending: dict[ray.ObjectRef, Request] = {}
        self.groups: Groups | None = None
        self.plan: SyncPlan | None = None
        self._rollout_busy_last = 0.0
        self._failed_last = 0
        self.rejoin_needed = False
        self.restarts = 0
        self.version_base = 0  # engine version when RL step 0 began (see groups_allowed_in_flight)
        self._next_actor = itertools.cycle(range(cfg.rollout.num_actors))

    # -- setup ---------------------------------------------------------------------------------
    def setup(self) -> None:
        cfg = self.cfg
        self.groups = place(cfg)
        g = self.groups
        t = cfg.trainer
        addr, port = get(g.trainers[0].address.remote(), t.step_timeout_s, "trainer rank 0 start")
        get([tr.init_distributed.remote(addr, port) for tr in g.trainers], t.step_timeout_s,
            "trainer process-group init")
        metas = get(g.trainers[0].parameter_metas.remote(), t.step_timeout_s, "parameter metadata")
        self.plan = plan_buckets([TensorMeta(n, tuple(s), d) for n, s, d in metas],
                                 int(cfg.rollout.sync_bucket_mb * 2**20))
        self.init_weight_group()
        self.hooks.setup()  # fresh: sync version 0; resume: load the checkpoint, sync its weights

    def init_weight_group(self) -> None:
        """(Re)build the weight-sync group: trainer rank 0 plus every rollout actor, on a fresh
        rendezvous port (a group whose member died cannot be repaired, only replaced)."""
        g, cfg = self.groups, self.cfg
        wait_ready(g.rollouts, cfg.rollout.generate_timeout_s)
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
        metrics = {"sync_time_s": elapsed, "sync_gb_per_s": sent / max(elapsed, 1e-9) / 1e9}
        metrics.update(self.check_canary(version))
        return metrics

    def canary_pairs(self) -> list[tuple[list[int], list[int]]]:
        vocab_size = next(m.shape[0] for b in self.plan.buckets for m in b.metas
                          if m.name.endswith("embed_tokens.weight"))
        return canary_prompts(vocab_size, num_prompts=self.cfg.rollout.canary_prompts, seed=self.cfg.seed + 1234)

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

    # -- generation ----------------------------------------------------------------------------
    def groups_allowed_in_flight(self, batches_started: int) -> int:
        """Groups that may be generating or buffered now. A group launched at engine version v
        is trained by a step s >= batches_started (steps whose batch was not yet taken) and must
        satisfy s - v <= max_off_policy_steps, so only the batches of steps up to
        v + max_off_policy_steps may be in flight."""
        a = self.cfg.algo
        # steps' policy versions run from version_base (an SFT warm-up or a resume moves it)
        steps_synced = self.version - self.version_base
        return max(0, (steps_synced + a.max_off_policy_steps + 1 - batches_started) * a.batch_groups)

    def launch(self, batches_started: int) -> None:
        r, a = self.cfg.rollout, self.cfg.algo
        queued = sum(len(q.tasks) for q in self.pending.values()) + len(self.buffer)
        per_actor_cap = r.max_requests_per_actor
        if self.rejoin_needed:  # a restarted engine would serve stale weights until the rejoin
            return
        while queued < self.groups_allowed_in_flight(batches_started) and len(self.pending) < per_actor_cap * r.num_actors:
            n_tasks = min(r.tasks_per_request, self.groups_allowed_in_flight(batches_started) - queued)
            indices, tasks = self.feed.take(n_tasks)
            actor = next(self._next_actor)
            ref = self.groups.rollouts[actor].generate_groups.remote(tasks, a.group_size, "train",
                                                                     self.feed.seed(indices))
            self.pending[ref] = Request(actor, tasks, n_tasks * a.group_size, time.perf_counter(), indices,
                                        self.request_seq)
            self.request_seq += 1
            self.buffer.launched(n_tasks * a.group_size)
            queued += n_tasks

    def collect(self, ref: ray.ObjectRef) -> int:
        """Move a finished request's groups into the buffer; returns completion tokens."""
        req = self.pending.pop(ref)
        try:
            groups: list[Group] = ray.get(ref, timeout=0)
        except ray.exceptions.RayError as exc:
            log.warning("generate request on rollout actor %d failed (%s): %d samples counted failed",
                        req.actor, type(exc).__name__, req.samples)
            self.buffer.fail(req.samples)
            if isinstance(exc, ray.exceptions.RayActorError):
                self.rejoin_needed = True  # Ray restarts it; it must get the weights first
            return 0
        for group, index in zip(groups, req.indices):
            group.request_id, group.stream_index = req.seq, index
        for group in groups:
            self.buffer.add(group)
        return sum(len(s.completion_ids) for g in groups for s in g.samples if not s.failed)

    def expire(self) -> None:
        """Count requests older than the generate timeout as failed (and cancel them)."""
        now = time.perf_counter()
        for ref, req in list(self.pending.items()):
            if now - req.launched_at > self.cfg.rollout.generate_timeout_s:
                ray.cancel(ref, force=False)
                del self.pending[ref]
                self.buffer.fail(req.samples)
                log.warning("generate request on rollout actor %d timed out: %d samples counted failed",
                            req.actor, req.samples)

    # -- training ------------------------------------------------------------------------------
    def advantages(self, batch: list[Group]) -> list[float]:
        """Per-sample advantages, in batch order. Groups that lost failed samples can differ in
        size; equal-size groups go through the estimator together (batch-level estimators such
        as REINFORCE++ see the whole batch)."""
        def tensors(groups):
            return (torch.tensor([g.rewards for g in groups], dtype=torch.float32),
                    torch.tensor([[sum(s.loss_mask) for s in g.samples] for g in groups], dtype=torch.float32))
        if len({len(g.samples) for g in batch}) == 1:
            rewards, lengths = tensors(batch)
            adv = compute_advantages(rewards, self.cfg.algo, lengths=lengths)
            return adv.flatten().tolist()
        out = []
        for g in batch:
            r, lengths = tensors([g])
            out.extend(compute_advantages(r, self.cfg.algo, lengths=lengths).flatten().tolist())
        return out

    def keep_group(self, group: Group) -> bool:
        """Dynamic sampling (DAPO): a group whose rewards are all equal has zero advantage."""
        return bool(nonzero_advantage_groups(torch.tensor([group.rewards]))[0])

    def start_train(self, state: StepState) -> list[ray.ObjectRef]:
        cfg = self.cfg
        samples = [s for g in state.batch for s in g.samples]
        flat_adv = self.advantages(state.batch)
        # one shard per data-parallel rank; context-parallel ranks share their group's shard
        shards = pack_for_ranks(samples, flat_adv, data_parallel_size(cfg.trainer), cfg.trainer.micro_batch_tokens)
        loss_tokens = sum(int(mb.loss_mask.sum()) for shard in shards for mb in shard)
        normalizer = loss_normalizer(cfg.algo, loss_tokens, len(samples), cfg.rollout.sampling.max_new_tokens)
        all_rewards = [s.reward for s in samples]
        state.metrics.update({
            "reward_mean": sum(all_rewards) / len(all_rewards),
            "reward_std": float(torch.tensor(all_rewards).std(unbiased=False)),
            "completion_len_mean": sum(len(s.completion_ids) for s in samples) / len(samples),
            "truncated_frac": sum(s.finish_reason == "length" for s in samples) / len(samples),
            "multiturn_prefix_breaks": sum(s.prefix_breaks for s in samples),
            "max_staleness": state.max_staleness,
            "batch_samples": len(samples),
        })
        # each rank fetches its own shard from the object store
        refs = shards_per_rank([ray.put(shard) for shard in shards], cfg.trainer)
        return [tr.train_step.remote(ref, normalizer) for tr, ref in zip(self.groups.trainers, refs)]

    # -- the loop ------------------------------------------------------------------------------
    def run(self, logger: MetricsLogger) -> list[dict[str, Any]]:
        """Train `cfg.steps` steps; a fault that stops the run says where it can resume from."""
        try:
            return self._run(logger)
        except RunError as exc:
            raise RunError(f"{exc}; {self.resume_hint()}") from exc

    def _run(self, logger: MetricsLogger) -> list[dict[str, Any]]:
        cfg = self.cfg
        history: list[dict[str, Any]] = []
        step = self.start_step
        self.version_base = self.version - step
        self._failed_last = self.acct.failed  # a resume restores the counters
        train_refs: list[ray.ObjectRef] = []
        state: StepState | None = None
        gen_tokens = 0
        run_start = last_end = time.perf_counter()
        while step < cfg.steps:
            if self.rejoin_needed and not train_refs:
                log.warning("rollout actor restarted: rebuilding the weight group, re-sending version %d",
                            self.version)
                self.rejoin(self.version)
            self.launch(step + (1 if train_refs else 0))
            if not train_refs:
                keep = self.keep_group if cfg.algo.filter_zero_adv_groups else None
                batch = self.buffer.pop_batch(self.version, cfg.algo.batch_groups, keep)
                if batch is not None:
                    batch.sort(key=lambda g: g.stream_index)  # arrival order is timing: train in data order
                    state = StepState(step, batch, self.buffer.max_staleness(batch, self.version))
                    train_refs = self.start_train(state)
                    self.launch(step + 1)
            waiting = list(self.pending) + train_refs[:1] + self.hooks.refs()
            if not waiting:
                raise RunError("nothing in flight and no batch ready: the staleness bound starves the run")
            ready, _ = ray.wait(waiting, num_returns=1, timeout=1.0)
            self.expire()
            for ref in ready:
                if ref in self.pending:
                    gen_tokens += self.collect(ref)
                elif self.hooks.owns(ref):
                    self.hooks.on_ready(ref, logger)
            if train_refs and refs_ready(train_refs):
                results = get(train_refs, cfg.trainer.step_timeout_s, f"train step {step + 1}",
                              [f"trainer rank {i}" for i in range(len(train_refs))])
                train_refs = []
                state.metrics.update(results[0])
                state.metrics.update(self.sync_weights(results[0]["version"]))
                now = time.perf_counter()
                record = self.step_record(state, now - last_end, now - run_start, gen_tokens)
                logger.log(record)
                history.append(record)
                step, last_end, gen_tokens = step + 1, now, 0
                self.hooks.after_step(step, state, logger)
        self.hooks.finish(logger)
        return history

    def resume_hint(self) -> str:
        """Where a stopped run can continue from."""
        from rlcore.checkpoint import latest_checkpoint
        path = self.hooks.last_checkpoint or latest_checkpoint(self.hooks.writer.root)
        if path is None:
            return "no checkpoint was written yet (set checkpoint.interval to write them)"
        return f"last checkpoint: {path}; continue with resume=true"

    def rollout_busy_seconds(self) -> float | None:
        """Generation seconds summed over rollout actors; None when one does not answer within
        10 s or was restarted (busy accounting must never stall or fail training)."""
        refs = [r.busy_seconds.remote() for r in self.groups.rollouts]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=10.0)
        if len(ready) < len(refs):
            return None
        try:
            return sum(ray.get(ready))
        except ray.exceptions.RayError:
            return None

    def step_record(self, state: StepState, step_time: float, elapsed: float, gen_tokens: int) -> dict[str, Any]:
        self.acct.check()
        m = dict(state.metrics)
        m.pop("version", None)
        failed_before, self._failed_last = self._failed_last, self.acct.failed
        busy = self.rollout_busy_seconds()
        rollout_busy = None
        if busy is not None:
            if busy >= self._rollout_busy_last:  # a restarted actor's clock starts again at 0
                rollout_busy = (busy - self._rollout_busy_last) / max(step_time * len(self.groups.rollouts), 1e-9)
            self._rollout_busy_last = busy
        dt = max(step_time, 1e-9)
        return {
            "step": state.step + 1,
            "policy_version": self.version,
            "step_time_s": step_time,
            "tokens_per_s": m.pop("train_tokens") / dt,
            "samples_per_s": m["batch_samples"] / dt,
            "gen_tokens_per_s": gen_tokens / dt,
            "trainer_busy_frac": min(1.0, (m["train_time_s"] + m["sync_time_s"]) / dt),
            "rollout_busy_frac": None if rollout_busy is None else min(1.0, rollout_busy),
            "elapsed_s": elapsed,
            **m,
            **self.acct.as_metrics(),
            "samples_failed_step": self.acct.failed - failed_before,  # reward/tool/engine faults
            "rollout_restarts": self.restarts,
        }

    def shutdown(self) -> None:
        if self.groups is not None:
            self.groups.shutdown()
            self.groups = None


def refs_ready(refs: list[ray.ObjectRef]) -> bool:
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
    return len(ready) == len(refs)


def config_dict(cfg: RunConfig) -> dict[str, Any]:
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)
