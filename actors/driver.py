"""The Ray driver of an RL run: keeps generation going, trains on fresh groups, pushes weights,
logs. Its loop (`_run`) reads as what it does; each verb belongs to a component with its own state:
`RolloutGroup` (requests in flight, engine deaths and restarts), `RolloutBuffer` (finished groups,
staleness), `rlcore.batch.step.build_step` (the step as data), `TrainerGroup` (the ranks), `WeightSync`
(the weights to the engines, and whatever the placement needs around a step), `StepHooks`
(checkpoints, evaluation, export), all sharing one explicit `RunState`.

Over 400 lines: the loop and the verbs it calls read as one page; each verb's state lives in its component.

Event loop (one thread): launch generate requests while the staleness bound allows, wait for
whichever remote call finishes first, and react: a finished request fills the buffer (through
the teacher stage in on-policy distillation); a full buffer starts a train step; a finished train
step is followed by a weight sync, which advances the policy version, and the step is logged.
Restarted engines join only at a step boundary. Generation never waits for training except where
`max_off_policy_steps` says so (0 gives the synchronous schedule on the same path). Rollout data
passes as refs: the driver keeps each group's metadata and the ref of its token data, plans the
step from metadata, and each trainer rank fetches its own samples (`actors.rollout_refs` says
where the driver still reads token data, and why).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import ray

from actors.groups import Groups, bundle_nodes, multi_node, note_moved, place
from actors.lifecycle import StepHooks
from actors.profiling import RunProfiler
from actors.recovery import TrainerRecovery
from actors.remote import ActorDied, RunError
from actors.rollout_group import RolloutGroup
from actors.rollout_refs import log_sample_nodes, table_rows
from actors.run_state import RunState, TaskFeed, groups_allowed_in_flight
from actors.starts import Starts
from actors.teacher import TeacherError, TeacherEvents, TeacherStage
from actors.trainer_group import TokenDataLost, TrainerGroup
from actors.weights import WeightSync
from rlcore.batch.buffer import Accounting, RolloutBuffer
from rlcore.batch.parallel_dims import shards_per_rank
from rlcore.batch.staleness import most_groups_in_flight
from rlcore.batch.step import build_step, has_signal
from rlcore.engine.registry import weight_transport
from rlcore.engine.slots import RequestLimits
from rlcore.envs import build_env
from rlcore.models.tokenizer_build import build_tokenizer
from rlcore.plan.interrupt import StopRequest
from rlcore.plan.layout import Plan
from rlcore.report import samples
from rlcore.report.failures import FailureLog, NoProgress
from rlcore.report.metrics import MetricsLogger
from rlcore.report.startup import StartupPhases, process_age
from rlcore.storage.errors import StorageError
from rlcore.transfer import sender_for
from rlcore.types import GroupMeta

log = logging.getLogger("rlcore")


@dataclass
class StepState:
    """What the step being trained carries from batch to log line."""

    step: int
    batch: list[GroupMeta]
    max_staleness: int
    metrics: dict[str, Any] = field(default_factory=dict)


class Driver:
    def __init__(self, plan: Plan, stop: StopRequest | None = None):
        """`plan`: what `rlcore.plan.layout.run_plan` decided (the groups to place; its config is
        the run's). `stop`: once requested (Ctrl-C, SIGTERM), the loop ends at the next step boundary."""
        cfg = plan.config
        self.cfg, self.plan, self.stop = cfg, plan, stop
        acct = Accounting()
        self.failures = FailureLog(cfg.rollout.stop_after_failed_requests)  # reasons, liveness
        a = cfg.algo
        # the launch rule keeps at most most_groups_in_flight (with a batch to spare), plus the
        # overdue groups it stopped counting (rlcore.batch.stragglers): at most every task of
        # every request the actors may hold
        r = cfg.rollout
        capacity = (
            most_groups_in_flight(a.max_off_policy_steps, a.batch_groups)
            + a.batch_groups
            + (1 + RequestLimits.of(r).held) * r.num_actors * r.tasks_per_request
        )
        self.buffer = RolloutBuffer(a.max_off_policy_steps, capacity, acct)
        self.synchronous = a.max_off_policy_steps == 0  # its syncs wait for an evaluation running
        self.env = build_env(cfg.env)
        self.run_state = RunState(acct, TaskFeed(self.env, cfg))
        self.groups: Groups | None = None
        self.trainers: TrainerGroup | None = None
        self.rollouts: RolloutGroup | None = None
        self.weights: WeightSync | None = None
        self.hooks: StepHooks | None = None  # resume, checkpoints, evaluation, data-order log
        self.profiler: RunProfiler | None = None  # profile.steps
        self.recovery: TrainerRecovery | None = None  # a dead trainer rank: restart from the last checkpoint
        self.teacher: TeacherStage | None = None  # on-policy distillation: scores groups before the buffer
        self._rollout_busy_last = 0.0
        self._train_version = 0  # run.version when the train step in flight began
        self._failed_last = 0
        self._overdue_last = 0
        self.startup = StartupPhases()  # timed start-up phases (progress lines, run summary)
        self.ready_at: float | None = None  # process age (s) when step 1 began (the start-up figure)
        # renders the canary's task prompts and decodes the samples table (logger.samples_every)
        self.tokenizer = build_tokenizer(cfg.model)

    # -- setup ---------------------------------------------------------------------------------
    def setup(self) -> None:
        cfg, run = self.cfg, self.run_state
        with self.startup.phase("placing actors"):
            self.groups = place(self.plan)
        self.rollout_nodes = bundle_nodes(self.groups.rollout_pg) if self.groups.rollout_pg is not None else []
        self.samples_located = not multi_node()  # the first step's samples' nodes are logged once
        self.trainers = self.groups.trainers
        self.rollouts = RolloutGroup(
            self.plan,
            self.groups.rollouts,
            run,
            self.buffer,
            self.failures,
            lambda i: self.rollout_nodes[i][:8] if i < len(self.rollout_nodes) else "?",
        )
        self.weights = WeightSync(
            cfg, self.trainers, self.rollouts, sender_for(weight_transport(cfg)), run, self.env, self.tokenizer
        )
        # the engines, the trainer and a teacher start in the order their placement allows
        self.starts = Starts(self.plan, self.weights, self.startup)
        self.starts.begin()
        self.teacher = self.starts.teacher
        self.hooks = StepHooks(
            cfg,
            run,
            self.env,
            self.trainers,
            self.rollouts,
            self.weights,
            self.buffer,
            self.startup,
            self.starts,
            self.teacher,
        )
        # fresh: SFT warm-up, then sync version 0; resume: load the checkpoint, sync its weights
        self.hooks.setup()
        self.profiler = RunProfiler(cfg.profile, cfg.output_dir, self.trainers, self.rollouts)
        self.recovery = TrainerRecovery(
            cfg.trainer,
            self.trainers,
            self.rollouts,
            self.weights,
            self.hooks,
            run,
            self.buffer,
            self.teacher,
            self.failures,
        )

    # -- the loop ------------------------------------------------------------------------------
    def run(self, logger: MetricsLogger) -> list[dict[str, Any]]:
        """Train `cfg.steps` steps; a fault that stops the run says where it can resume from."""
        try:
            return self._run(logger)
        except (RunError, TeacherError, StorageError) as exc:  # StorageError: a series row not written
            raise RunError(f"{exc}; {self.resume_hint()}") from exc

    def _run(self, logger: MetricsLogger) -> list[dict[str, Any]]:
        cfg, run = self.cfg, self.run_state
        history: list[dict[str, Any]] = []
        self.begin()
        if self.ready_at is None:
            self.ready_at = process_age()
        train: list[ray.ObjectRef] = []  # the refs of the train step in flight
        state: StepState | None = None
        gen_tokens = 0
        run_start = last_end = time.perf_counter()
        while run.step < cfg.steps:
            try:
                if not train and self.stopping():  # a signal asked for a stop: this is a step boundary
                    self.weights.finish_canary()
                    return history
                if not train:  # a step boundary: restarted engines whose model is up join
                    self.admit_restarted()
                self.launch(run.step + (1 if train else 0))
                if not train and (state := self.next_batch()) is not None:
                    self.profiler.begin(state.step + 1)  # profile.steps: every process records it
                    train = self.start_train(state)
                    self.launch(run.step + 1)
                gen_tokens += self.react(self.wait(train), logger)
                if train and self.trainers.step_done(train):
                    gen_tokens += self.train_and_sync(train, state, logger)
                    train, now = [], time.perf_counter()
                    self.profiler.end(state.step + 1)  # (its traces' hand-back falls in the next step's time)
                    record = self.step_record(state, now - last_end, now - run_start, gen_tokens)
                    self.log_step(record, state, logger)
                    history.append(record)
                    run.step, last_end, gen_tokens = run.step + 1, now, 0
                    self.hooks.after_step(run.step, state, logger)
            except TokenDataLost as exc:  # its node or actor died with it: those groups fail, the step runs again
                self.drop_lost(state, exc.refs, exc.why)
                train, state = [], None
            except ActorDied as exc:  # a trainer rank died: new ranks from the engines' weights or a checkpoint
                # a batch whose step died before its weights were synced was never trained
                unfinished = state.batch if train and run.version == self._train_version else None
                step = self.recovery.recover(exc, logger, unfinished)
                history[:] = [r for r in history if r["step"] <= step]
                if self.recovery.rewound:
                    self.begin()
                else:
                    run.version_base = run.version - run.step  # a synced step whose row was lost moves it
                train, state, gen_tokens, last_end = [], None, 0, time.perf_counter()
        self.weights.finish_canary()  # the last sync's, when it ran beside the last step
        self.profiler.close()
        self.hooks.finish(logger)
        return history

    def begin(self) -> None:
        """Counters the loop starts from, after a setup, a resume or a trainer restart."""
        run = self.run_state
        run.version_base = run.version - run.step
        self._failed_last = run.acct.failed  # a resume restores the counters
        self.failures.resume_at(run.request_seq)  # the no-progress streak follows launch order

    # -- the loop's verbs ----------------------------------------------------------------------
    def stopping(self) -> bool:
        """Whether a signal asked the run to stop; if so, save this step boundary (one line says
        what was kept, `StepHooks.interrupted`)."""
        if self.stop is None or not self.stop.requested:
            return False
        self.hooks.interrupted(self.run_state.step, self.stop.signal_name)
        return True

    def admit_restarted(self) -> None:
        """Restarted engines that are up join the weight group (call only between steps)."""
        joined = self.weights.admit_restarted()
        if joined:
            self.hooks.engines_joined()
            self.rollout_nodes = note_moved(
                self.groups.rollout_pg,
                self.rollout_nodes,
                joined,  # after a node died
                self.run_state.step,
            )

    def launch(self, batches_started: int) -> None:
        """Keep as many groups generating as the staleness bound allows (`groups_allowed_in_flight`)."""
        a = self.cfg.algo
        queued = len(self.buffer) + (self.teacher.waiting_groups() if self.teacher is not None else 0)
        allowed = groups_allowed_in_flight(self.run_state, batches_started, a.max_off_policy_steps, a.batch_groups)
        self.rollouts.launch(allowed, queued)

    def next_batch(self) -> StepState | None:
        """The next step's batch from the buffer (stale groups dropped), in data order; None: not yet."""
        cfg, run = self.cfg, self.run_state
        keep = has_signal if cfg.algo.filter_zero_adv_groups else None
        batch = self.buffer.pop_batch(run.version, cfg.algo.batch_groups, keep)
        if batch is None:
            return None
        batch.sort(key=lambda g: g.stream_index)  # arrival order is timing: train in data order
        return StepState(run.step, batch, self.buffer.max_staleness(batch, run.version))

    def start_train(self, state: StepState) -> list[ray.ObjectRef]:
        cfg = self.cfg
        self._train_version = self.run_state.version
        state.metrics.update(self.weights.before_train())  # e.g. the engines free a shared GPU
        plan = build_step(state.batch, cfg, distill=self.teacher is not None)  # metadata only
        state.metrics.update(plan.metrics, max_staleness=state.max_staleness)
        # each rank fetches its own samples' token data from the object store and packs them
        return self.trainers.launch_step(shards_per_rank(plan.ranks, cfg.trainer), plan.normalizer)

    def wait(self, train: list[ray.ObjectRef]) -> list[ray.ObjectRef]:
        """Wait (at most 1 s) for the first of: a generate request, the train step, an evaluation
        request, a restart probe, a teacher call."""
        waiting = self.rollouts.refs() + train[:1] + self.hooks.refs() + self.rollouts.probes()
        waiting += self.teacher.refs() if self.teacher is not None else []
        if waiting:
            return ray.wait(waiting, num_returns=1, timeout=1.0)[0]
        if self.rollouts.restarting or self.rollouts.held():  # engines restarting / data refs to read again
            time.sleep(0.1)
            return []
        raise RunError("nothing in flight and no batch ready: the staleness bound starves the run")

    def react(self, ready: list[ray.ObjectRef], logger: MetricsLogger) -> int:
        """Expire what is overdue, note restarted engines, hand each finished ref to its owner,
        and stop a run that makes no progress; returns the completion tokens collected."""
        if self.teacher is not None:
            self.from_teacher(self.teacher.expire())
        self.rollouts.expire()
        self.rollouts.watch()  # a frozen engine leaves in seconds; its requests go to the others
        self.rollouts.poll()  # restarted engines that answered are noted (they join at a step boundary)
        # streams whose last group's token-data ref was slow to follow its metadata: read again
        tokens = sum(self.collect(gen, data_wait_s=0.0) for gen in self.rollouts.held() if gen not in ready)
        for ref in ready:
            if self.rollouts.owns(ref):
                tokens += self.collect(ref)
            elif self.teacher is not None and self.teacher.owns(ref):
                self.from_teacher(self.teacher.on_ready(ref))
            elif self.hooks.owns(ref):
                self.hooks.on_ready(ref, logger)
        try:
            self.failures.check()
        except NoProgress as exc:
            raise RunError(str(exc)) from exc
        return tokens

    def collect(self, gen, data_wait_s: float | None = None) -> int:
        """Move the groups a request's stream delivered into the buffer, or to the teacher stage
        first; returns completion tokens."""
        groups = self.rollouts.collect(gen, data_wait_s)
        if self.teacher is not None:
            self.from_teacher(self.teacher.submit(groups))  # the buffer gets them once scored
        else:
            for group in groups:
                self.buffer.add(group)
        return sum(s.completion_len for g in groups for s in g.samples if not s.failed)

    def train_and_sync(self, train: list[ray.ObjectRef], state: StepState, logger: MetricsLogger) -> int:
        """Finish the train step, then sync its weights to the engines (the new policy version);
        a synchronous run's sync first lets an evaluation still running finish on the policy it
        evaluates (`StepHooks.holds_sync`), the loop's watchers going on meanwhile. Returns the
        completion tokens collected while it waited."""
        result = self.trainers.finish_step(train, state.step + 1)
        state.metrics.update(result.metrics)
        state.metrics.update(self.weights.after_train())  # e.g. the engines wake on a shared GPU
        tokens = 0
        while self.synchronous and self.hooks.holds_sync():
            tokens += self.react(self.wait([]), logger)
        state.metrics.update(self.weights.sync(result.version))
        return tokens

    def drop_lost(self, state: StepState, refs: list, why: str = "lost with the node that made it") -> None:
        """The batch of a step no rank trained because some of its groups' token data was lost
        (`why`: with the node or the actor that made it): those groups fail (one reason, named in
        the failures), the others go back to the front of the buffer for the next step."""
        lost_ids = {ref.binary() for ref in refs}
        lost = [g for g in state.batch if g.data is not None and g.data.binary() in lost_ids]
        self.buffer.put_back([g for g in state.batch if all(g is not x for x in lost)])
        samples = self.buffer.lose(lost)
        self.failures.request_lost(
            samples,
            f"engine: token data {why}",
            f"{len(lost)} group(s) of step {state.step + 1}; the step runs again without them",
            streak=False,
            task=lost[0].task if lost else None,
        )
        log.warning(
            "step %d: the token data of %d group(s) (%d samples) was %s; "
            "they are counted failed and the step runs again without them",
            state.step + 1,
            len(lost),
            samples,
            why,
        )
        self.weights.after_train()  # engines that slept for the step wake (colocated)

    def log_step(self, record: dict[str, Any], state: StepState, logger: MetricsLogger) -> None:
        logger.log(record)
        if not self.samples_located and self.groups.trainer_pg is not None:  # where the samples went
            log_sample_nodes(state.batch, self.rollout_nodes, bundle_nodes(self.groups.trainer_pg))
            self.samples_located = True
        failed = self.failures.take_examples()  # a few failed samples per reason, this step's
        if samples.due(record["step"], self.cfg.logger.samples_every):
            limit = self.cfg.logger.samples_per_table
            # what the step's forward computed for the samples shown, read from the ranks now
            trainer = self.trainers.last_step_logprobs(samples.shown_keys(state.batch, limit), state.metrics["version"])
            rows = table_rows(
                state.batch,
                lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True),
                limit,
                self.cfg.rollout.generate_timeout_s,
                trainer,
                failed,
            )
            if rows is not None:
                logger.log_samples(record["step"], rows)

    def resume_hint(self) -> str:
        """Where a stopped run can continue from."""
        if self.hooks is None:
            return "no checkpoint was written yet (set checkpoint.interval to write them)"
        path = self.hooks.newest_checkpoint()
        if path is None:
            return "no checkpoint was written yet (set checkpoint.interval to write them)"
        return f"last checkpoint: {path}; continue with resume=true"

    def step_record(self, state: StepState, step_time: float, elapsed: float, gen_tokens: int) -> dict[str, Any]:
        """The step's metrics row; checks the accounting identity first (every step)."""
        acct = self.run_state.acct
        acct.check()
        m = dict(state.metrics)
        m.pop("version", None)
        failed_before, self._failed_last = self._failed_last, acct.failed
        overdue_before, self._overdue_last = self._overdue_last, self.rollouts.overdue_groups
        busy = self.rollouts.busy_seconds()
        rollout_busy = None
        if busy is not None:
            if busy >= self._rollout_busy_last:  # a restarted actor's clock starts again at 0
                rollout_busy = (busy - self._rollout_busy_last) / max(
                    step_time * max(1, len(self.rollouts.serving)), 1e-9
                )
            self._rollout_busy_last = busy
        dt = max(step_time, 1e-9)
        return {
            "step": state.step + 1,
            "policy_version": self.run_state.version,
            "step_time_s": step_time,
            "tokens_per_s": m.pop("train_tokens") / dt,
            "samples_per_s": m["batch_samples"] / dt,
            "gen_tokens_per_s": gen_tokens / dt,
            # a buffered transport's step also wrote the weights into its buffer (sync_in_step)
            "trainer_busy_frac": min(
                1.0,
                (
                    m["train_time_s"]
                    + m.get("train_fetch_s", 0.0)
                    + m["sync_time_s"]
                    + m.get("sync_in_step", 0.0) * m.get("sync_send_s", 0.0)
                )
                / dt,
            ),
            "rollout_busy_frac": None if rollout_busy is None else min(1.0, rollout_busy),
            "generate_time_s": None if rollout_busy is None else rollout_busy * dt,  # per actor
            "elapsed_s": elapsed,
            **m,
            **acct.as_metrics(),
            "samples_failed_step": acct.failed - failed_before,  # reward/tool/engine faults
            **self.failures.step_metrics(),  # failed_by_reason, reward_threads_abandoned
            "groups_overdue": self.rollouts.overdue_groups - overdue_before,  # rlcore.batch.stragglers
            **self.restart_counts(),
            **(self.teacher.step_metrics(step_time) if self.teacher is not None else {}),
        }

    def restart_counts(self) -> dict[str, int]:
        """The row's restart counters: the run's, over all its submissions (as `samples_failed`)."""
        run = self.run_state
        mine = {
            "rollout_restarts": self.rollouts.restarts,
            "rollout_stalls": self.rollouts.stalled_count,
            "trainer_restarts": self.recovery.restarts if self.recovery is not None else 0,
        }
        run.restarts_logged = {k: run.restarts_before.get(k, 0) + v for k, v in mine.items()}
        return dict(run.restarts_logged)

    def from_teacher(self, events: TeacherEvents) -> None:
        """The teacher stage's events: scored groups go to the buffer; the samples of a failed
        score call are failed, counted under their reason."""
        for group in events.scored:
            self.buffer.add(group)
        for lost, why in events.failed:
            self.buffer.fail(lost)
            self.failures.request_lost(lost, why, streak=False)  # the teacher stage has its own

    def shutdown(self) -> None:
        if self.teacher is not None:
            self.teacher.shutdown()
            self.teacher = None
        if self.groups is not None:
            self.groups.shutdown()
            self.groups = None
