"""The Ray driver: keeps generation going, trains on fresh groups, pushes weights, logs.

Event loop (one thread): launch generate requests while the staleness bound allows, wait for
whichever remote call finishes first, and react: a finished request fills the buffer; a full
buffer starts a train step; a finished train step starts a weight sync; a finished sync
advances the policy version and logs the step. Generation never waits for training except
where `max_off_policy_steps` says so (0 gives the synchronous schedule on the same path).
Rollout data passes as refs: the driver keeps each group's metadata and the ref of its token
data, plans the step from metadata, and each trainer rank fetches its own samples
(`actors.rollout_refs` says where the driver still reads token data, and why).
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import ray

from actors import colocation
from actors.groups import Groups, bundle_nodes, place
from actors.lifecycle import StepHooks, TaskFeed
from actors.membership import Members
from actors.remote import ActorDied, RunError, failed_names, get, refs_ready, wait_ready  # noqa: F401 (re-exported)
from actors.rollout_refs import launch_generate, log_sample_nodes, request_groups, table_rows
from actors.teacher import TeacherError, TeacherStage
from actors.weights import WeightSync
from rlcore import samples
from rlcore.buffer import Accounting, RolloutBuffer
from rlcore.checkpoint import latest_checkpoint
from rlcore.config import RunConfig
from rlcore.engine.registry import sleep_level
from rlcore.envs import make_env
from rlcore.failures import FailureLog, NoProgress
from rlcore.metrics import MetricsLogger
from rlcore.models.build import build_tokenizer
from rlcore.startup import StartupPhases
from rlcore.step import build_step, has_signal
from rlcore.trainer.parallel import shards_per_rank
from rlcore.transfer.plan import SyncPlan, TensorMeta, plan_buckets
from rlcore.types import GroupMeta, Task

log = logging.getLogger("rlcore")


@dataclass
class Request:
    actor: int
    tasks: list[Task]
    samples: int
    launched_at: float
    indices: list[int] = field(default_factory=list)
    """Train-stream index of each task (data order; put back on resume)."""
    seq: int = -1
    data: list = field(default_factory=list)
    """Token-data ref of each task's group (the driver owns them; trainer ranks read them)."""


@dataclass
class StepState:
    """What the step being trained carries from batch to log line."""

    step: int
    batch: list[GroupMeta]
    max_staleness: int
    metrics: dict[str, Any] = field(default_factory=dict)


class Driver(WeightSync):
    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.acct = Accounting()
        self.failures = FailureLog(cfg.rollout.stop_after_failed_requests)  # reasons, liveness
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
        self.members: Members | None = None  # the rollout actors that serve (see actors.membership)
        self.teacher: TeacherStage | None = None  # on-policy distillation: scores groups before the buffer
        self.plan: SyncPlan | None = None
        self._rollout_busy_last = 0.0
        self._failed_last = 0
        self.restarts = 0
        self.version_base = 0  # engine version when RL step 0 began (see groups_allowed_in_flight)
        self._next_actor = itertools.cycle(range(cfg.rollout.num_actors))
        self._canary_pairs: list[tuple[list[int], list[int]]] | None = None
        self.startup = StartupPhases()  # timed start-up phases (progress lines, run summary)
        # renders the canary's task prompts and decodes the samples table (logger.samples_every)
        self.tokenizer = build_tokenizer(cfg.model)
        self.colocated = cfg.placement == "colocated"
        self.sleep_level = sleep_level(cfg.rollout) if self.colocated else 0

    # -- setup ---------------------------------------------------------------------------------
    def setup(self) -> None:
        cfg = self.cfg
        phase = self.startup.phase
        with phase("placing actors"):
            self.groups = place(cfg)
        g = self.groups
        self.rollout_nodes = bundle_nodes(g.rollout_pg) if g.rollout_pg is not None else []  # node of each engine
        self.members = Members(g.rollouts, cfg.rollout.generate_timeout_s)
        t = cfg.trainer
        engines = f"starting the rollout engine{'s' if len(g.rollouts) > 1 else ''} ({cfg.rollout.engine})"
        if self.colocated:  # vLLM sizes its memory at startup: let it start before the trainer allocates
            with phase(engines):
                wait_ready(g.rollouts, cfg.rollout.generate_timeout_s)
        with phase("starting the trainer and loading its model"):
            addr, port = get(g.trainers[0].address.remote(), t.step_timeout_s, "trainer rank 0 start")
            get([tr.init_distributed.remote(addr, port) for tr in g.trainers], t.step_timeout_s,
                "trainer process-group init")
            metas = get(g.trainers[0].parameter_metas.remote(), t.step_timeout_s, "parameter metadata")
        self.plan = plan_buckets([TensorMeta(n, tuple(s), d) for n, s, d in metas],
                                 int(cfg.rollout.sync_bucket_mb * 2**20))
        if not self.colocated:
            with phase(engines):
                wait_ready(g.rollouts, cfg.rollout.generate_timeout_s)  # model load (and vLLM's compile)
        with phase("joining the weight-sync group"):
            self.init_weight_group()
        if cfg.teacher.enabled:  # after the rollout engines are up: engines sharing a GPU start one by one
            with phase("starting the teacher"):
                self.teacher = TeacherStage(cfg, self.buffer.add, self.teacher_failed)
                try:
                    self.teacher.start()
                except TeacherError as exc:
                    raise RunError(str(exc)) from exc
        self.hooks.setup()  # fresh: sync version 0; resume: load the checkpoint, sync its weights

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
        if self.teacher is not None:
            queued += self.teacher.waiting_groups()
        serving = self.members.serving  # a restarted engine takes requests once it has the weights
        while (serving and queued < self.groups_allowed_in_flight(batches_started)
               and len(self.pending) < r.max_requests_per_actor * len(serving)):
            n_tasks = min(r.tasks_per_request, self.groups_allowed_in_flight(batches_started) - queued)
            indices, tasks = self.feed.take(n_tasks)
            actor = next(self._next_actor)
            while actor not in serving:
                actor = next(self._next_actor)
            ref, data = launch_generate(self.groups.rollouts[actor], tasks, a.group_size, self.feed.seed(indices))
            self.pending[ref] = Request(actor, tasks, n_tasks * a.group_size, time.perf_counter(), indices,
                                        self.request_seq, data)
            self.request_seq += 1
            self.buffer.launched(n_tasks * a.group_size)
            queued += n_tasks

    def collect(self, ref: ray.ObjectRef) -> int:
        """Move a finished request's groups (metadata and token-data refs) into the buffer, or
        to the teacher stage first; returns completion tokens."""
        req = self.pending.pop(ref)
        try:
            groups = request_groups(ray.get(ref, timeout=0), req.tasks, req.data, req.seq, req.indices)
        except ray.exceptions.RayError as exc:
            log.warning("generate request on rollout actor %d failed (%s): %d samples counted failed",
                        req.actor, type(exc).__name__, req.samples)
            self.buffer.fail(req.samples)
            self.failures.request_lost(req.samples, f"engine: {type(exc).__name__}", str(exc))
            if isinstance(exc, ray.exceptions.RayActorError):
                self.engine_lost(req.actor, req.launched_at)  # Ray restarts it; the others serve on
            return 0
        self.failures.request_done(groups, req.actor)
        if self.teacher is not None:
            self.teacher.submit(groups)  # the buffer gets them once scored
        else:
            for group in groups:
                self.buffer.add(group)
        return sum(s.completion_len for g in groups for s in g.samples if not s.failed)

    def expire(self) -> None:
        """Count requests older than the generate timeout (and teacher calls older than theirs)
        as failed (and cancel them)."""
        if self.teacher is not None:
            self.teacher.expire()
        now = time.perf_counter()
        for ref, req in list(self.pending.items()):
            if now - req.launched_at > self.cfg.rollout.generate_timeout_s:
                ray.cancel(ref, force=False)
                del self.pending[ref]
                self.buffer.fail(req.samples)
                log.warning("generate request on rollout actor %d timed out: %d samples counted failed",
                            req.actor, req.samples)
                self.failures.request_lost(
                    req.samples, f"engine: generate request timed out (rollout.generate_timeout_s="
                                 f"{self.cfg.rollout.generate_timeout_s:g})")

    # -- training ------------------------------------------------------------------------------
    def start_train(self, state: StepState) -> list[ray.ObjectRef]:
        cfg = self.cfg
        plan = build_step(state.batch, cfg, distill=self.teacher is not None)  # metadata only
        state.metrics.update(plan.metrics, max_staleness=state.max_staleness)
        # each rank fetches its own samples' token data from the object store and packs them
        works = shards_per_rank(plan.ranks, cfg.trainer)
        return [tr.train_step.remote(work, plan.normalizer) for tr, work in zip(self.groups.trainers, works)]

    # -- the loop ------------------------------------------------------------------------------
    def run(self, logger: MetricsLogger) -> list[dict[str, Any]]:
        """Train `cfg.steps` steps; a fault that stops the run says where it can resume from."""
        try:
            return self._run(logger)
        except (RunError, TeacherError) as exc:
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
            if not train_refs:  # a step boundary: restarted engines whose model is up join
                self.admit_restarted()
            self.launch(step + (1 if train_refs else 0))
            if not train_refs:
                keep = has_signal if cfg.algo.filter_zero_adv_groups else None
                batch = self.buffer.pop_batch(self.version, cfg.algo.batch_groups, keep)
                if batch is not None:
                    batch.sort(key=lambda g: g.stream_index)  # arrival order is timing: train in data order
                    state = StepState(step, batch, self.buffer.max_staleness(batch, self.version))
                    if self.sleep_level:  # hybrid schedule: the engines free the GPU for the step
                        state.metrics["sleep_s"] = colocation.sleep_engines(
                            self.groups, self.sleep_level, get, cfg.rollout.weight_sync_timeout_s)
                    train_refs = self.start_train(state)
                    self.launch(step + 1)
            waiting = list(self.pending) + train_refs[:1] + self.hooks.refs() + self.members.probes()
            waiting += self.teacher.refs() if self.teacher is not None else []
            if waiting:
                ready, _ = ray.wait(waiting, num_returns=1, timeout=1.0)
            elif self.members.restarting:  # every engine is restarting: wait for the next probe
                ready = []
                time.sleep(0.1)
            else:
                raise RunError("nothing in flight and no batch ready: the staleness bound starves the run")
            self.expire()
            self.members.poll()  # restarted engines that answered are noted (they join at a step boundary)
            for ref in ready:
                if ref in self.pending:
                    gen_tokens += self.collect(ref)
                elif self.teacher is not None and self.teacher.owns(ref):
                    self.teacher.on_ready(ref)
                elif self.hooks.owns(ref):
                    self.hooks.on_ready(ref, logger)
            try:
                self.failures.check()
            except NoProgress as exc:
                raise RunError(str(exc)) from exc
            if train_refs and refs_ready(train_refs):
                results = get(train_refs, cfg.trainer.step_timeout_s, f"train step {step + 1}",
                              [f"trainer rank {i}" for i in range(len(train_refs))])
                train_refs = []
                pushed = [r.pop("weights_pushed") for r in results] if "weights_pushed" in results[0] else None
                state.metrics.update(results[0])
                if self.sleep_level:
                    state.metrics["wake_s"] = colocation.wake_engines(self.groups, get, cfg.rollout.weight_sync_timeout_s)
                state.metrics.update(self.sync_weights(results[0]["version"], pushed))
                now = time.perf_counter()
                record = self.step_record(state, now - last_end, now - run_start, gen_tokens)
                logger.log(record)
                if record["step"] == self.start_step + 1:  # where the samples went (once)
                    log_sample_nodes(state.batch, bundle_nodes(self.groups.rollout_pg) if self.groups.rollout_pg else [],
                                     bundle_nodes(self.groups.trainer_pg))
                if samples.due(record["step"], cfg.logger.samples_every):
                    rows = table_rows(state.batch, lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True),
                                      cfg.logger.samples_per_table, cfg.rollout.generate_timeout_s)
                    if rows is not None:
                        logger.log_samples(record["step"], rows)
                history.append(record)
                step, last_end, gen_tokens = step + 1, now, 0
                self.hooks.after_step(step, state, logger)
        self.hooks.finish(logger)
        return history

    def resume_hint(self) -> str:
        """Where a stopped run can continue from."""
        path = self.hooks.last_checkpoint or latest_checkpoint(self.hooks.writer.root)
        if path is None:
            return "no checkpoint was written yet (set checkpoint.interval to write them)"
        return f"last checkpoint: {path}; continue with resume=true"

    def step_record(self, state: StepState, step_time: float, elapsed: float, gen_tokens: int) -> dict[str, Any]:
        self.acct.check()
        m = dict(state.metrics)
        m.pop("version", None)
        failed_before, self._failed_last = self._failed_last, self.acct.failed
        busy = self.members.busy_seconds()
        rollout_busy = None
        if busy is not None:
            if busy >= self._rollout_busy_last:  # a restarted actor's clock starts again at 0
                rollout_busy = (busy - self._rollout_busy_last) / max(step_time * max(1, len(self.members.serving)), 1e-9)
            self._rollout_busy_last = busy
        dt = max(step_time, 1e-9)
        return {
            "step": state.step + 1,
            "policy_version": self.version,
            "step_time_s": step_time,
            "tokens_per_s": m.pop("train_tokens") / dt,
            "samples_per_s": m["batch_samples"] / dt,
            "gen_tokens_per_s": gen_tokens / dt,
            # a colocated step also wrote the weights into the IPC buffer (sync_in_step)
            "trainer_busy_frac": min(1.0, (m["train_time_s"] + m.get("train_fetch_s", 0.0) + m["sync_time_s"]
                                           + m.get("sync_in_step", 0.0) * m.get("sync_send_s", 0.0)) / dt),
            "rollout_busy_frac": None if rollout_busy is None else min(1.0, rollout_busy),
            "generate_time_s": None if rollout_busy is None else rollout_busy * dt,  # per actor
            "elapsed_s": elapsed,
            **m,
            **self.acct.as_metrics(),
            "samples_failed_step": self.acct.failed - failed_before,  # reward/tool/engine faults
            **self.failures.step_metrics(),  # failed_by_reason, reward_threads_abandoned
            "rollout_restarts": self.restarts,
            **(self.teacher.step_metrics(step_time) if self.teacher is not None else {}),
        }

    def teacher_failed(self, samples: int, why: str) -> None:
        """A teacher score call failed: its samples are failed, counted under their reason."""
        self.buffer.fail(samples)
        self.failures.request_lost(samples, why, streak=False)  # the teacher stage has its own

    def teacher_groups(self) -> list[GroupMeta]:
        """Groups waiting for the teacher (a checkpoint puts their tasks back, like generating ones)."""
        return self.teacher.groups() if self.teacher is not None else []

    def shutdown(self) -> None:
        if self.teacher is not None:
            self.teacher.shutdown()
            self.teacher = None
        if self.groups is not None:
            self.groups.shutdown()
            self.groups = None
