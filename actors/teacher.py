"""The teacher group of on-policy distillation: engines that score the student's finished samples
(teacher-forced logprobs of the sampled tokens), on their own placement group, and the driver's
scoring stage between generation and the buffer.

Flow: a finished generate request's groups (metadata, `GroupMeta`) go to `TeacherStage.submit`
instead of the buffer. A score call hands a teacher actor the groups' token-data refs only: Ray
resolves them in the actor (`TeacherWorker.score`), which scores the non-failed samples, attaches
the teacher logprobs and returns the scored groups as new objects the driver owns (a per-call
`num_returns`; like the objects of `RolloutWorker.generate_stream`, they outlive the teacher actor). The driver
reads return 0 only (busy seconds, each sample's teacher sums) and hands the buffer each group's
metadata with the new data ref: it never touches token data on this path. Scoring is
asynchronous (generation never waits: the driver's event loop waits on teacher calls like on
generate calls). Samples at the teacher stay counted `in_flight` (the accounting identity holds
at every step). A score call that fails (a length mismatch of the returned logprobs included),
times out, or whose actor died counts its samples failed; a dead actor is probed (Ray restarts it
up to `teacher.max_restarts`) and dropped when it is gone for good; with no teacher left the run
stops with one line.
Teachers never receive weights.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from dataclasses import dataclass, field

import ray
from ray.util.placement_group import (
    PlacementGroup,
    placement_group,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.actor_config import config_env, remote_class
from actors.groups import specs
from actors.remote import ReadyWatch, RunError
from actors.teacher_worker import TeacherWorker, attach, one_line, score_pairs  # noqa: F401 (re-exported)
from rlcore.plan.layout import Plan
from rlcore.types import GroupMeta

log = logging.getLogger("rlcore")


class TeacherError(RuntimeError):
    """The teacher group cannot go on (every actor gone, or it did not start in time)."""


@dataclass
class ScoreRequest:
    actor: int
    groups: list[GroupMeta]
    launched_at: float
    data: list = field(default_factory=list)
    """Returns 1..n of the score call: the scored token data of each group (the driver owns them)."""

    @property
    def samples(self) -> int:
        return sum(len(g.samples) for g in self.groups)


@dataclass
class StepStats:
    """Teacher figures since the last step record."""

    latencies: list[float] = field(default_factory=list)
    failed: int = 0
    straddled: int = 0
    tokens: int = 0


def scored(group: GroupMeta, sums: list, data) -> GroupMeta:
    """`group` once scored: the same metadata with each sample's teacher sums, its token data at
    `data` (the teacher's return object)."""
    if len(sums) != len(group.samples):
        raise ValueError(f"teacher returned {len(sums)} samples' sums for a group of {len(group.samples)}")
    return dataclasses.replace(
        group, data=data, samples=[dataclasses.replace(m, teacher_sums=t) for m, t in zip(group.samples, sums)]
    )


class ScoreFailed(RuntimeError):
    """A score call whose teacher actor reported a scoring fault (the message is its reason)."""


@dataclass
class TeacherEvents:
    """What the stage's calls produced, for the loop owner to act on: groups scored (or with
    nothing to score), ready for the buffer; score calls lost, as (samples, reason)."""

    scored: list[GroupMeta] = field(default_factory=list)
    failed: list[tuple[int, str]] = field(default_factory=list)


class TeacherStage:
    """Driver-side stage: queue, dispatch, collect and expire score calls; place and own the
    teacher actors. It holds metadata and refs only, and calls nothing of its owner: `submit`,
    `on_ready` and `expire` return :class:`TeacherEvents` (the groups ready for the buffer, the
    samples lost). `rollout.stop_after_failed_requests` score calls failing in a row stop the
    run (TeacherError), as all-failed generate requests do. `plan`: its teacher group's bundles
    and the run's config (a local `teacher.path` made absolute: `rlcore.plan.layout.run_plan`)."""

    def __init__(self, plan: Plan):
        self.cfg, self.bundles = plan.config, plan.teacher
        self.calls_per_actor = self.cfg.teacher.max_requests_per_actor  # score calls in flight at each actor
        self.events = TeacherEvents()  # gathered by the flow methods, handed over by `_events`
        self.failed_in_a_row = 0
        self.pg: PlacementGroup | None = None
        self.actors: list = []
        self.alive: list[bool] = []
        self.pending: dict[ray.ObjectRef, ScoreRequest] = {}
        self.probes: dict[ray.ObjectRef, tuple[int, float]] = {}
        self.queue: deque[list[GroupMeta]] = deque()
        self.stats = StepStats()
        self._busy_last: dict[int, float] = {}
        self._busy_step = 0.0
        self._next = 0
        self.watch: ReadyWatch | None = None  # the actors' start (`launch`)

    # -- placement -------------------------------------------------------------------------------
    def start(self) -> None:
        """Place the teacher actors and wait until each answers `ready()` (`launch`, then `wait`)."""
        self.launch()
        self.wait()

    def launch(self) -> None:
        """Place the teacher actors and start them, without waiting for their model loads (`poll`
        and `wait` watch them, with `teacher.start_timeout_s` from now)."""
        t = self.cfg.teacher
        bundles = specs(self.bundles)
        self.pg = placement_group(bundles, strategy="PACK", name="rlcore-teacher")
        ready, _ = ray.wait([self.pg.ready()], timeout=self.cfg.cluster.placement_timeout_s)
        if not ready:
            raise TeacherError(
                f"teacher placement group {bundles} not scheduled within "
                f"{self.cfg.cluster.placement_timeout_s:.0f}s; cluster has {ray.available_resources()}"
            )
        cls = remote_class(TeacherWorker)  # the config travels in the runtime_env: restarts never need a freed object
        self.actors = [
            cls.options(
                num_cpus=b.cpus,
                num_gpus=b.gpus,
                max_concurrency=self.calls_per_actor + 1,
                max_restarts=t.max_restarts,
                max_task_retries=0,
                runtime_env=config_env(self.cfg, t.env_vars),
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=i),
            ).remote(i)
            for i, b in enumerate(self.bundles)
        ]
        self.alive = [True] * len(self.actors)
        self.watch = ReadyWatch(self.actors, t.start_timeout_s, "teacher actor")

    def poll(self) -> bool:
        """Never blocks: whether every teacher actor is up (TeacherError if one failed to start)."""
        try:
            return self.watch.poll()
        except RunError as exc:
            raise TeacherError(f"the teacher did not start: {exc}") from exc

    def wait(self) -> None:
        """Block until every teacher actor is up (TeacherError if one failed or the time ran out)."""
        try:
            self.watch.join()
        except RunError as exc:
            raise TeacherError(f"the teacher did not start: {exc}") from exc

    def shutdown(self) -> None:
        for a in self.actors:
            ray.kill(a, no_restart=True)
        if self.pg is not None:
            remove_placement_group(self.pg)
            self.pg = None
        self.actors = []

    # -- flow ------------------------------------------------------------------------------------
    def submit(self, groups: list[GroupMeta]) -> TeacherEvents:
        """Finished groups from one generate request: score them (now, or when a slot frees)."""
        self.queue.append(groups)
        self.dispatch()
        return self._events()

    def _events(self) -> TeacherEvents:
        events, self.events = self.events, TeacherEvents()
        return events

    def drop(self) -> None:
        """Forget the groups queued or being scored (a trainer restart goes back to a checkpoint
        that puts their tasks back; the accounting is the checkpoint's). Calls still running
        finish unread."""
        self.queue.clear()
        self.pending.clear()

    def waiting_groups(self) -> int:
        """Groups at the teacher (queued or being scored): in flight for the staleness bound."""
        return sum(len(g) for g in self.queue) + sum(len(r.groups) for r in self.pending.values())

    def groups(self) -> list[GroupMeta]:
        """The groups at the teacher, queued first."""
        return [g for gs in self.queue for g in gs] + [g for r in self.pending.values() for g in r.groups]

    def waiting_samples(self) -> int:
        return sum(len(g.samples) for gs in self.queue for g in gs) + sum(r.samples for r in self.pending.values())

    def refs(self) -> list[ray.ObjectRef]:
        return list(self.pending) + list(self.probes)

    def owns(self, ref: ray.ObjectRef) -> bool:
        return ref in self.pending or ref in self.probes

    def dispatch(self) -> None:
        cap = self.calls_per_actor
        n = len(self.actors)
        while self.queue:
            load = {i: 0 for i in range(n) if self.alive[i]}
            if not load:
                if self.probes:  # an actor is restarting: its queue waits for it
                    return
                raise TeacherError("teacher group: every teacher actor died (restarts exhausted)")
            for req in self.pending.values():
                if req.actor in load:
                    load[req.actor] += 1
            order = [(self._next + k) % n for k in range(n)]  # round robin over the live actors
            free = [i for i in order if i in load and load[i] < cap]
            if not free:
                return
            actor = free[0]
            self._next = (actor + 1) % n
            groups = self.queue.popleft()
            if all(s.failed for g in groups for s in g.samples):  # nothing to score
                self.events.scored.extend(groups)
                continue
            # top-level refs: Ray resolves them in the actor, the driver never reads them
            refs = self.actors[actor].score.options(num_returns=1 + len(groups)).remote(*[g.data for g in groups])
            self.pending[refs[0]] = ScoreRequest(actor, groups, time.perf_counter(), list(refs[1:]))

    def on_ready(self, ref: ray.ObjectRef) -> TeacherEvents:
        """A finished score call or restart probe of this stage (`owns(ref)`)."""
        if ref in self.probes:
            self._probed(ref)
        else:
            self._collect(ref)
        self.dispatch()
        return self._events()

    def _collect(self, ref: ray.ObjectRef) -> None:
        req = self.pending.pop(ref)
        try:
            busy, sums, error, straddle = ray.get(ref, timeout=0)  # return 0: small; the scored data stays in the store
            if error is not None:
                raise ScoreFailed(error)
            if len(sums) != len(req.groups):
                raise ValueError(f"teacher returned {len(sums)} groups for {len(req.groups)}")
            groups = [scored(g, t, d) for g, t, d in zip(req.groups, sums, req.data)]
        except (ray.exceptions.RayError, ValueError, ScoreFailed) as exc:
            self._failed(req, str(exc) if isinstance(exc, ScoreFailed) else one_line(exc))
            if isinstance(exc, ray.exceptions.RayActorError):
                self._probe(req.actor)
            return
        self.failed_in_a_row = 0
        self.stats.latencies.append(time.perf_counter() - req.launched_at)
        self.stats.straddled += straddle[0]
        self.stats.tokens += straddle[1]
        last = self._busy_last.get(req.actor, 0.0)
        self._busy_step += busy - last if busy >= last else busy  # a restarted actor's clock starts at 0
        self._busy_last[req.actor] = busy
        self.events.scored.extend(groups)

    def _failed(self, req: ScoreRequest, why: str) -> None:
        log.warning(
            "teacher score call on teacher actor %d failed (%s): %d samples counted failed", req.actor, why, req.samples
        )
        self.events.failed.append((req.samples, f"teacher: {why}"))
        self.stats.failed += req.samples
        self.failed_in_a_row += 1
        limit = self.cfg.rollout.stop_after_failed_requests
        if limit and self.failed_in_a_row >= limit:
            raise TeacherError(
                f"no progress: the last {self.failed_in_a_row} teacher score calls failed "
                f"(rollout.stop_after_failed_requests={limit}); the last: {why}"
            )

    def _probe(self, actor: int) -> None:
        """Stop dispatching to a dead actor until it answers again (Ray restarting it) or is gone."""
        if not self.alive[actor] or any(a == actor for a, _ in self.probes.values()):
            return
        self.alive[actor] = False
        self.probes[self.actors[actor].ready.remote()] = (actor, time.perf_counter())

    def _probed(self, ref: ray.ObjectRef) -> None:
        actor, _ = self.probes.pop(ref)
        try:
            ray.get(ref, timeout=0)
        except ray.exceptions.RayError as exc:
            log.warning("teacher actor %d is gone (%s)", actor, type(exc).__name__)
            self._busy_last.pop(actor, None)
            if not any(self.alive) and not self.probes:
                raise TeacherError("teacher group: every teacher actor died (restarts exhausted)") from exc
            return
        log.warning("teacher actor %d restarted; scoring on it again", actor)
        self.alive[actor] = True
        self._busy_last[actor] = 0.0

    def expire(self) -> TeacherEvents:
        """Score calls older than `teacher.score_timeout_s` count their samples failed; a probe
        older than `teacher.start_timeout_s` gives the actor up."""
        now = time.perf_counter()
        for ref, req in list(self.pending.items()):
            if now - req.launched_at > self.cfg.teacher.score_timeout_s:
                ray.cancel(ref, force=False)
                del self.pending[ref]
                self._failed(req, f"timed out after {self.cfg.teacher.score_timeout_s:.0f}s")
        for ref, (actor, since) in list(self.probes.items()):
            if now - since > self.cfg.teacher.start_timeout_s:
                del self.probes[ref]
                log.warning("teacher actor %d did not come back within %.0fs", actor, self.cfg.teacher.start_timeout_s)
                if not any(self.alive) and not self.probes:
                    raise TeacherError("teacher group: every teacher actor died or hangs")
        self.dispatch()
        return self._events()

    # -- metrics ---------------------------------------------------------------------------------
    def step_metrics(self, step_time: float) -> dict[str, float]:
        """`teacher_latency_s` (mean submit-to-result time of the step's score calls),
        `teacher_latency_max_s`, `teacher_busy_frac` (scoring seconds / (step time x actors)),
        `samples_at_teacher` (in flight at the teacher), `teacher_failed_step` and, with
        `teacher.cross_tokenizer`, `teacher_straddle_frac` (completion tokens whose teacher
        logprob is a straddled segment's share, `rlcore.algo.span_align`)."""
        lat, n = self.stats.latencies, max(len(self.actors), 1)
        out = {
            "teacher_latency_s": sum(lat) / len(lat) if lat else None,
            "teacher_latency_max_s": max(lat) if lat else None,
            "teacher_busy_frac": min(1.0, self._busy_step / max(step_time * n, 1e-9)),
            "samples_at_teacher": self.waiting_samples(),
            "teacher_failed_step": self.stats.failed,
        }
        if self.cfg.teacher.cross_tokenizer:
            out["teacher_straddle_frac"] = self.stats.straddled / self.stats.tokens if self.stats.tokens else None
        self.stats = StepStats()
        self._busy_step = 0.0
        return out
