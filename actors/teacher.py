"""The teacher group of on-policy distillation: engines that score the student's finished samples
(teacher-forced logprobs of the sampled tokens), on their own placement group, and the driver's
scoring stage between generation and the buffer.

Flow: a finished generate request's groups go to `TeacherStage.submit` instead of the buffer;
a teacher actor scores them asynchronously (generation never waits: the driver's event loop
waits on teacher calls like on generate calls); `collect` attaches the logprobs and hands the
groups on to the buffer. Samples at the teacher stay counted `in_flight` (the accounting
identity holds at every step). A score call that fails, times out, or whose actor died counts
its samples failed; a dead actor is probed (Ray restarts it up to `teacher.max_restarts`) and
dropped when it is gone for good; with no teacher left the run stops with one line.
Teachers never receive weights.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

import ray
import torch
from ray.util.placement_group import (
    PlacementGroup,
    placement_group,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.groups import bundle
from actors.logs import QUIET_ENV, redirect_output
from rlcore.busy import BusyClock
from rlcore.config import RunConfig
from rlcore.engine.registry import make_engine
from rlcore.models.build import build_tokenizer
from rlcore.teacher import resolved, teacher_run_config, tokenizer_fingerprint
from rlcore.types import Group

log = logging.getLogger("rlcore")


class TeacherError(RuntimeError):
    """The teacher group cannot go on (every actor gone, or it did not start in time)."""


class TeacherWorker:
    """One teacher engine. `score` returns the teacher-forced logprobs of each (prompt,
    completion) pair and the actor's cumulative busy seconds (for the busy fraction)."""

    def __init__(self, cfg: RunConfig, index: int):
        redirect_output(cfg.output_dir, "teacher", index)
        self.index = index
        torch.set_num_threads(max(1, int(cfg.teacher.cpus_per_actor)))
        tcfg = teacher_run_config(cfg)
        self.tokenizer = build_tokenizer(tcfg.model)
        if tokenizer_fingerprint(self.tokenizer) != tokenizer_fingerprint(build_tokenizer(cfg.model)):
            # a hub teacher is only comparable once loaded (validation compares local ones)
            raise ValueError(f"teacher.path: {cfg.teacher.path}: its tokenizer differs from the student's")
        self.engine = make_engine(tcfg, self.tokenizer, seed=cfg.seed * 1000 + 500 + index)
        self.clock = BusyClock()

    def ready(self) -> int:
        return self.index

    def score(self, pairs: list[tuple[list[int], list[int]]]) -> tuple[list[list[float]], float]:
        with self.clock.busy():
            out = self.engine.score_batch(pairs)
        return out, self.clock.seconds()


@dataclass
class ScoreRequest:
    actor: int
    groups: list[Group]
    launched_at: float

    @property
    def samples(self) -> int:
        return sum(len(g.samples) for g in self.groups)


@dataclass
class StepStats:
    """Teacher figures since the last step record."""

    latencies: list[float] = field(default_factory=list)
    failed: int = 0


def score_pairs(groups: list[Group]) -> list[tuple[list[int], list[int]]]:
    """The (prompt, completion) ids of every sample the teacher must score (failed ones are not)."""
    return [(s.prompt_ids, s.completion_ids) for g in groups for s in g.samples if not s.failed]


def attach(groups: list[Group], logprobs: list[list[float]]) -> None:
    """Give each scored sample its teacher logprobs, in `score_pairs` order."""
    it = iter(logprobs)
    for g in groups:
        for s in g.samples:
            if not s.failed:
                lp = next(it)
                if len(lp) != len(s.completion_ids):
                    raise ValueError(f"teacher returned {len(lp)} logprobs for {len(s.completion_ids)} tokens")
                s.teacher_logprobs = list(lp)


class TeacherStage:
    """Driver-side stage: queue, dispatch, collect and expire score calls; place and own the
    teacher actors. `add` hands scored groups on; `fail(n, why)` counts n samples failed for
    reason `why`. `rollout.stop_after_failed_requests` score calls failing in a row stop the run
    (TeacherError), as all-failed generate requests do."""

    def __init__(self, cfg: RunConfig, add, fail):
        self.cfg, self.add, self.fail = resolved(cfg), add, fail
        self.failed_in_a_row = 0
        self.pg: PlacementGroup | None = None
        self.actors: list = []
        self.alive: list[bool] = []
        self.pending: dict[ray.ObjectRef, ScoreRequest] = {}
        self.probes: dict[ray.ObjectRef, tuple[int, float]] = {}
        self.queue: deque[list[Group]] = deque()
        self.stats = StepStats()
        self._busy_last: dict[int, float] = {}
        self._busy_step = 0.0
        self._next = 0

    # -- placement -------------------------------------------------------------------------------
    def start(self) -> None:
        t = self.cfg.teacher
        bundles = [bundle(t.cpus_per_actor, t.gpus_per_actor) for _ in range(t.num_actors)]
        self.pg = placement_group(bundles, strategy="PACK", name="rlcore-teacher")
        ready, _ = ray.wait([self.pg.ready()], timeout=self.cfg.cluster.placement_timeout_s)
        if not ready:
            raise TeacherError(f"teacher placement group {bundles} not scheduled within "
                               f"{self.cfg.cluster.placement_timeout_s:.0f}s; cluster has {ray.available_resources()}")
        cls = ray.remote(TeacherWorker)
        self.actors = [cls.options(
            num_cpus=t.cpus_per_actor, num_gpus=t.gpus_per_actor, max_concurrency=t.max_requests_per_actor + 1,
            max_restarts=t.max_restarts, max_task_retries=0,
            runtime_env={"env_vars": {"NCCL_NVLS_ENABLE": "0", "TOKENIZERS_PARALLELISM": "false", **QUIET_ENV}},
            scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=i),
        ).remote(self.cfg, i) for i in range(t.num_actors)]
        self.alive = [True] * t.num_actors
        try:
            ray.get([a.ready.remote() for a in self.actors], timeout=t.start_timeout_s)
        except ray.exceptions.GetTimeoutError as exc:
            raise TeacherError(f"teacher actors not ready within {t.start_timeout_s:.0f}s") from exc
        except ray.exceptions.RayActorError as exc:
            raise TeacherError(f"a teacher actor failed to start: {str(exc).splitlines()[0]}") from exc

    def shutdown(self) -> None:
        for a in self.actors:
            ray.kill(a, no_restart=True)
        if self.pg is not None:
            remove_placement_group(self.pg)
            self.pg = None
        self.actors = []

    # -- flow ------------------------------------------------------------------------------------
    def submit(self, groups: list[Group]) -> None:
        """Finished groups from one generate request: score them (now, or when a slot frees)."""
        self.queue.append(groups)
        self.dispatch()

    def waiting_groups(self) -> int:
        """Groups at the teacher (queued or being scored): in flight for the staleness bound."""
        return sum(len(g) for g in self.queue) + sum(len(r.groups) for r in self.pending.values())

    def groups(self) -> list[Group]:
        """The groups at the teacher, queued first."""
        return [g for gs in self.queue for g in gs] + [g for r in self.pending.values() for g in r.groups]

    def waiting_samples(self) -> int:
        return (sum(len(g.samples) for gs in self.queue for g in gs)
                + sum(r.samples for r in self.pending.values()))

    def refs(self) -> list[ray.ObjectRef]:
        return list(self.pending) + list(self.probes)

    def owns(self, ref: ray.ObjectRef) -> bool:
        return ref in self.pending or ref in self.probes

    def dispatch(self) -> None:
        cap = self.cfg.teacher.max_requests_per_actor
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
            pairs = score_pairs(groups)
            if not pairs:  # every sample failed already: nothing to score
                for g in groups:
                    self.add(g)
                continue
            ref = self.actors[actor].score.remote(pairs)
            self.pending[ref] = ScoreRequest(actor, groups, time.perf_counter())

    def on_ready(self, ref: ray.ObjectRef) -> None:
        if ref in self.probes:
            self._probed(ref)
        else:
            self._collect(ref)
        self.dispatch()

    def _collect(self, ref: ray.ObjectRef) -> None:
        req = self.pending.pop(ref)
        try:
            logprobs, busy = ray.get(ref, timeout=0)
            attach(req.groups, logprobs)
        except (ray.exceptions.RayError, ValueError) as exc:
            self._failed(req, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
            if isinstance(exc, ray.exceptions.RayActorError):
                self._probe(req.actor)
            return
        self.failed_in_a_row = 0
        self.stats.latencies.append(time.perf_counter() - req.launched_at)
        last = self._busy_last.get(req.actor, 0.0)
        self._busy_step += busy - last if busy >= last else busy  # a restarted actor's clock starts at 0
        self._busy_last[req.actor] = busy
        for g in req.groups:
            self.add(g)

    def _failed(self, req: ScoreRequest, why: str) -> None:
        log.warning("teacher score call on teacher actor %d failed (%s): %d samples counted failed",
                    req.actor, why, req.samples)
        self.fail(req.samples, f"teacher: {why}")
        self.stats.failed += req.samples
        self.failed_in_a_row += 1
        limit = self.cfg.rollout.stop_after_failed_requests
        if limit and self.failed_in_a_row >= limit:
            raise TeacherError(f"no progress: the last {self.failed_in_a_row} teacher score calls failed "
                               f"(rollout.stop_after_failed_requests={limit}); the last: {why}")

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

    def expire(self) -> None:
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

    # -- metrics ---------------------------------------------------------------------------------
    def step_metrics(self, step_time: float) -> dict[str, float]:
        """`teacher_latency_s` (mean submit-to-result time of the step's score calls),
        `teacher_latency_max_s`, `teacher_busy_frac` (scoring seconds / (step time x actors)),
        `samples_at_teacher` (in flight at the teacher) and `teacher_failed_step`."""
        lat, n = self.stats.latencies, max(len(self.actors), 1)
        out = {
            "teacher_latency_s": sum(lat) / len(lat) if lat else None,
            "teacher_latency_max_s": max(lat) if lat else None,
            "teacher_busy_frac": min(1.0, self._busy_step / max(step_time * n, 1e-9)),
            "samples_at_teacher": self.waiting_samples(),
            "teacher_failed_step": self.stats.failed,
        }
        self.stats = StepStats()
        self._busy_step = 0.0
        return out
