"""The rollout group: the rollout actors' handles, which of them serve (`actors.membership`), the
generate requests in flight, and the deaths and restarts of engines.

Over 400 lines: requests in flight, deaths and restarts all turn on one state (which actor serves) and stay with it.

`launch` keeps requests going while the staleness bound (given by the driver) and the per-actor
request limit allow, round-robin over the serving actors; `collect` takes the groups a request's
stream delivered since (`actors.rollout_stream`: each group as soon as it is scored; the groups
of a failed request not delivered become failed samples, counted); `expire` cancels requests
older than `rollout.generate_timeout_s`, counting their groups not delivered failed. An engine that dies leaves the serving set at once (`engine_lost`)
and joins again at a step boundary through `WeightSync.admit_restarted`. The rest are the
per-actor calls the driver and `WeightSync` make (weight-group join, pull, canary, sleep/wake,
busy seconds, RNG state), each returning refs or waiting with a deadline.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import ray

from actors.engine_rng import read_rng_states
from actors.membership import Members
from actors.remote import died, forget, get
from actors.rollout_stream import Ended, Stream, launch_stream
from actors.run_state import RunState
from actors.session import CapacityProbe
from actors.stall_watch import BEFORE_SYNC_S, StallWatch
from rlcore.batch.buffer import RolloutBuffer
from rlcore.batch.stragglers import ScoringLags
from rlcore.engine.slots import RequestLimits
from rlcore.plan.layout import Plan
from rlcore.report.events import event
from rlcore.report.failures import FailureLog
from rlcore.report.faults import memory_kill
from rlcore.transfer.plan import SyncPlan
from rlcore.types import GroupMeta, Task

log = logging.getLogger("rlcore")

PROBE_TIMEOUT_S = 10.0
"""How long `dead_engines` and `busy_seconds` wait for an answer."""
CONTROL_TIMEOUT_S = 60.0
"""Deadline of the small per-actor calls (RNG state get / set)."""


class RolloutGroup:
    """`handles`: the rollout actors (index i is "rollout actor i"), placed by `plan` (their pools,
    their bundles). Failed or expired samples are counted in `buffer` (accounting) and `failures`
    (reasons, liveness)."""

    def __init__(
        self,
        plan: Plan,
        handles: list,
        run: RunState,
        buffer: RolloutBuffer,
        failures: FailureLog,
        node_of: Callable[[int], str] = lambda i: "?",
    ):
        cfg = plan.config
        self.cfg, self.handles, self.run, self.node_of = cfg, handles, run, node_of
        self.buffer, self.failures = buffer, failures
        self.timeout_s = cfg.rollout.generate_timeout_s
        self.limits = RequestLimits.of(cfg.rollout)  # requests kept at each actor
        # why no alive node can host an engine's bundle again (colocated: the shared one); never blocks
        self.capacity_gone = CapacityProbe(cfg.cluster, plan.rollout[:1] or plan.trainer[:1])
        self.members = Members(handles, self.timeout_s, self.capacity_gone)
        self.stalls = StallWatch(handles, cfg.rollout.stall_timeout_s)
        self.pending: dict[ray.ObjectRefGenerator, Stream] = {}
        self.roles = plan.roles
        """Each actor's pool (`rlcore.plan.layout.Plan.roles`): prefill actors take no requests of
        the driver's, only the decode actors' prefill calls (`actors.pd_router`)."""
        self.prefill = [i for i, role in enumerate(self.roles) if role == "prefill"]
        self._told_prefill: list[int] | None = None  # the prefill serving set the routers were told last
        self.lags = ScoringLags()
        self.overdue_groups = 0
        """Groups that went overdue while scoring (`rlcore.batch.stragglers`), over the run so far."""

    def __len__(self) -> int:
        return len(self.handles)

    @property
    def serving(self) -> list[int]:
        return self.members.serving

    @property
    def episode_serving(self) -> list[int]:
        """The serving actors that run episodes (all but a disaggregated group's prefill pool)."""
        return [i for i in self.members.serving if self.roles[i] != "prefill"]

    def label(self, actor: int) -> str:
        """`actor` in a log line: its pool too when the group is disaggregated."""
        return f"{actor}" + (f" ({self.roles[actor]})" if self.prefill else "")

    def tell_routers(self) -> None:
        """Never blocks: when the serving prefill engines changed, every decode actor's router
        learns them (a dead or frozen one is skipped at once; a rejoined one serves again)."""
        if not self.prefill:
            return
        now = [self.prefill.index(i) for i in self.members.serving if self.roles[i] == "prefill"]
        if now == self._told_prefill:
            return
        self._told_prefill = now
        forget([self.handles[i].set_prefill_serving.remote(now) for i in self.episode_serving])

    @staticmethod
    def names(actors: list[int]) -> list[str]:
        return [f"rollout actor {i}" for i in actors]

    def startup_notes(self) -> list[str]:
        """The engines' start-up lines (`RolloutWorker.startup_note`), each distinct one once,
        naming the actors that said it."""
        notes = get(
            [h.startup_note.remote() for h in self.handles],
            CONTROL_TIMEOUT_S,
            "engine start-up notes",
            self.names(list(range(len(self.handles)))),
        )
        said: dict[str, list[int]] = {}
        for i, note in enumerate(notes):
            if note:
                said.setdefault(note, []).append(i)
        return [
            f"{note} (rollout actor{'s' if len(ids) > 1 else ''} {', '.join(map(str, ids))})"
            for note, ids in said.items()
        ]

    # -- requests in flight --------------------------------------------------------------------
    def queued_tasks(self) -> int:
        """Tasks whose groups are generating or scoring (not delivered yet), less the overdue
        ones (`rlcore.batch.stragglers`: still scoring long after their request's first group came;
        they keep their request's place at the actor, not their place in the staleness budget)."""
        self._mark_overdue()
        return sum(len(q.tasks) - len(q.arrived) for q in self.pending.values() if not q.overdue)

    def _mark_overdue(self) -> None:
        after = self.lags.overdue_after_s()
        if after is None:
            return
        now = time.perf_counter()
        for q in self.pending.values():
            if not q.overdue and q.first_at is not None and now - q.first_at > after:
                q.overdue = True
                self.overdue_groups += len(q.tasks) - len(q.arrived)

    def launch(self, allowed: int, queued_elsewhere: int) -> None:
        """Launch requests while fewer than `allowed` groups are generating or waiting (this
        group's requests plus `queued_elsewhere`: buffered, at the teacher) and no serving actor
        holds, on average, more than `RequestLimits.undelivered` requests that delivered no group
        yet (it generates in `slots` of them; the others wait at the actor for a slot) nor more
        than `RequestLimits.held` in all (the rest only score)."""
        r, a, run, limits = self.cfg.rollout, self.cfg.algo, self.run, self.limits
        queued = self.queued_tasks() + queued_elsewhere
        self.tell_routers()
        serving = self.episode_serving  # a restarted engine takes requests once it has the weights
        generating = sum(1 for q in self.pending.values() if not q.arrived)
        while (
            serving
            and queued < allowed
            and generating < limits.undelivered * len(serving)
            and len(self.pending) < limits.held * len(serving)
        ):
            n_tasks = min(r.tasks_per_request, allowed - queued)
            indices, tasks = run.feed.take(n_tasks)
            actor = run.next_actor(len(self.handles) - len(self.prefill), serving)
            gen = launch_stream(self.handles[actor], tasks, a.group_size, run.feed.seed(indices))
            self.pending[gen] = Stream(actor, tasks, a.group_size, time.perf_counter(), gen, indices, run.request_seq)
            run.request_seq += 1
            self.buffer.launched(n_tasks * a.group_size)
            queued += n_tasks
            generating += 1

    def owns(self, ref) -> bool:
        return ref in self.pending

    def refs(self) -> list:
        """The streams to wait on: those whose next object is a group's metadata."""
        return [gen for gen, q in self.pending.items() if q.waitable]

    def held(self) -> list:
        """The streams whose last group's token-data ref has not come yet (read them again)."""
        return [gen for gen, q in self.pending.items() if not q.waitable]

    def collect(self, gen, data_wait_s: float | None = None) -> list[GroupMeta]:
        """The groups request `gen` delivered since the last call (metadata and token-data refs).
        When its stream has ended, the request leaves: groups it did not deliver are counted
        failed (an actor that died leaves the serving set)."""
        req = self.pending[gen]
        groups, ended = req.read() if data_wait_s is None else req.read(data_wait_s)
        if groups:
            now = time.perf_counter()
            for group in groups:
                self.lags.note(now - req.first_at, scored=not all(m.failed for m in group.samples))
            req.reasons.update(self.failures.groups_done(groups, req.actor)[2])
        if ended is not None:
            del self.pending[gen]
            self._ended(req, ended)
        return groups

    def _ended(self, req: Stream, ended: Ended) -> None:
        left, exc = req.samples_left, ended.error
        if left:
            why = f"engine: {type(exc).__name__}" if exc is not None else "engine: request ended without its groups"
            log.warning(
                "generate request on rollout actor %d %s: %d samples counted failed",
                req.actor,
                f"failed ({type(exc).__name__})" if exc is not None else "ended early",
                left,
            )
            self.buffer.fail(left)
            req.reasons.update(
                self.failures.request_lost(
                    left, why, str(exc or ""), streak=False, task=req.tasks[0] if req.tasks else None
                )
            )
        self.failures.request_finished(req.seq, req.all_failed, req.reasons)
        if exc is not None and died(exc):  # died, or killed by Ray's memory monitor: Ray restarts it
            self.engine_lost(req.actor, req.launched_at, memory_kill(str(exc)))

    def expire(self) -> None:
        """Count the groups not delivered of requests older than the generate timeout as failed
        (and cancel them)."""
        now = time.perf_counter()
        for gen, req in list(self.pending.items()):
            if now - req.launched_at > self.timeout_s:
                ray.cancel(gen, force=False)
                del self.pending[gen]
                left = req.samples_left
                self.buffer.fail(left)
                log.warning(
                    "generate request on rollout actor %d timed out: %d samples counted failed", req.actor, left
                )
                req.reasons.update(
                    self.failures.request_lost(
                        left,
                        f"engine: generate request timed out (rollout.generate_timeout_s={self.timeout_s:g})",
                        streak=False,
                        task=req.tasks[0] if req.tasks else None,
                    )
                )
                self.failures.request_finished(req.seq, req.all_failed, req.reasons)

    def frozen(self) -> list[str]:
        """`watch` for a blocking wait on the engines (`actors.remote.get`: a weight sync, its
        canary), at the shorter silence of `BEFORE_SYNC_S`: the names of the actors it took out."""
        return self.names(self.watch(BEFORE_SYNC_S))

    def watch(self, stall_s: float | None = None) -> list[int]:
        """Never blocks: a serving actor silent for `rollout.stall_timeout_s` (`StallWatch`) leaves
        the serving set like a dead one, and its requests are taken back: their tasks go to the
        engines that answer (as if never requested), and whatever they return later is read and
        dropped. It rejoins at a step boundary once it answers again (or once Ray, having declared
        its node dead, has restarted it elsewhere). `stall_s`: a shorter silence (before a weight
        sync, `stall_watch.BEFORE_SYNC_S`). Returns the actors taken out."""
        out = []
        for actor, asked_at in self.stalls.dead():  # a prefill engine has no stream to end with its death
            if self.roles[actor] == "prefill":
                self.engine_lost(actor, asked_at)
        for actor, silent in self.stalls.stalled(self.serving, stall_s):
            out.append(actor)
            taken = [(gen, q) for gen, q in self.pending.items() if q.actor == actor]
            for gen, q in taken:  # the groups delivered stay; the others' tasks go to other engines
                del self.pending[gen]
                ray.cancel(gen, force=False)
                self.buffer.withdraw(q.samples_left)
                self.run.feed.put_back(q.left())
                self.failures.request_withdrawn(q.seq)
            self.stalls.drop(actor)
            self.members.lost(actor, float("inf"), stalled=True)
            log.warning(
                "rollout actor %s on node %s: no progress for %.0f s; its %d request(s) (%d samples) go to "
                "the engines that answer (%d serve on); it rejoins once it answers again",
                self.label(actor),
                self.node_of(actor),
                silent,
                len(taken),
                sum(q.samples_left for _, q in taken),
                len(self.serving),
                extra=event("rollout_stalled", actor=actor, version=self.run.version, step=self.run.step),
            )
        return out

    def drop_pending(self) -> int:
        """Forget every request in flight without counting it (the caller restores the accounting
        of a checkpoint that puts their tasks back): each is cancelled, its stream dropped.
        Returns the samples dropped (of groups not delivered)."""
        samples = sum(q.samples_left for q in self.pending.values())
        for gen in self.pending:
            ray.cancel(gen, force=False)
        self.pending.clear()
        return samples

    def unfinished(self) -> list[tuple[int, Task]]:
        """(stream index, task) of every task whose group was not delivered (a checkpoint puts
        them back)."""
        return [it for req in self.pending.values() for it in req.left()]

    # -- deaths and restarts -------------------------------------------------------------------
    def engine_lost(self, actor: int, launched_at: float, cause: str | None = None) -> None:
        """A call to `actor` launched at `launched_at` failed because the actor died (`cause`:
        how, e.g. `rlcore.report.faults.memory_kill`'s line): it stops serving until Ray's restart of it
        has joined again (counted in `rollout_restarts`)."""
        if self.members.lost(actor, launched_at):
            self.stalls.drop(actor)
            log.warning(
                "rollout actor %s %s at version %d: %d engine(s) serve on while Ray restarts it",
                self.label(actor),
                cause or "died",
                self.run.version,
                len(self.serving),
                extra=event("rollout_died", actor=actor, version=self.run.version, step=self.run.step),
            )

    def dead_engines(self, actors: list[int]) -> list[int]:
        """Actors of `actors` that do not answer `ready()` within 10 s (died or restarting)."""
        if not actors:
            return []
        refs = [self.handles[i].ready.remote() for i in actors]
        ray.wait(refs, num_returns=len(refs), timeout=PROBE_TIMEOUT_S)
        dead = []
        for i, ref in zip(actors, refs):
            try:
                ray.get(ref, timeout=0)
            except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError):
                dead.append(i)
        return dead

    def holding(self, version: int) -> int | None:
        """A serving actor whose engine holds policy `version` (whole: a sync lands atomically),
        the first to answer within `PROBE_TIMEOUT_S`; None when none does."""
        refs = {self.handles[i].policy_version.remote(): i for i in self.serving}
        pending = list(refs)
        deadline = time.monotonic() + PROBE_TIMEOUT_S
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            try:
                if ray.get(ready[0], timeout=0) == version:
                    forget(pending)
                    return refs[ready[0]]
            except ray.exceptions.RayError:
                continue
        forget(pending)
        return None

    def weights(self, actor: int):
        """Ref: actor `actor`'s engine weights by trainer name (`RolloutWorker.state_dict`)."""
        return self.handles[actor].state_dict.remote()

    @property
    def restarts(self) -> int:
        """Deaths noticed (`rollout_restarts`)."""
        return self.members.deaths

    @property
    def stalled_count(self) -> int:
        """Actors taken out for silence (`rollout_stalls`)."""
        return self.members.stalls

    @property
    def restarting(self) -> bool:
        return bool(self.members.restarting)

    def probes(self) -> list[ray.ObjectRef]:
        return self.members.probes()

    def poll(self) -> list[int]:
        """Never blocks: the restarted actors ready to join (see `Members.poll`)."""
        return self.members.poll()

    @property
    def needs_reform(self) -> bool:
        """A member left since the weight group was formed: re-form it before the next sync."""
        return self.members.reform

    def group_formed(self) -> None:
        """The weight group was formed over the serving actors (`WeightSync.form`)."""
        self.members.reform = False

    def admit(self, actors: list[int]) -> list[int]:
        """`actors` hold the current weights in the re-formed group: they serve again."""
        self._told_prefill = None  # a restarted decode actor's router starts with every prefill engine: tell it
        return self.members.admit(actors)

    # -- per-actor calls -----------------------------------------------------------------------
    def join_group(self, actors: list[int], address: str, port: int, plan: SyncPlan) -> list:
        """Refs: actor `actors[j]` joins the weight group at `address:port` in slot j."""
        return [
            self.handles[i].init_weight_group.remote(address, port, plan, None, slot, len(actors))
            for slot, i in enumerate(actors)
        ]

    def open_buffers(self, actors: list[int], plan: SyncPlan, handles: list) -> list:
        """Refs: actor i of `actors` keeps `handles[i]`, the buffer of the trainer rank on its GPU."""
        return [self.handles[i].init_weight_group.remote("", 0, plan, handles[i]) for i in actors]

    def pull(self, actors: list[int], version: int) -> list:
        """Refs: each actor of `actors` receives the weights as `version`."""
        return [self.handles[i].pull_weights.remote(version) for i in actors]

    def release(self, actors: list[int], version: int) -> None:
        """Never blocks: the sync to `version` reached every engine of `actors` (both pools of a
        disaggregated group): their decode actors may decode prefills of it (`PrefillRouter.release`)."""
        if self.prefill:
            forget([self.handles[i].release_version.remote(version) for i in actors if self.roles[i] == "decode"])

    def canary_completions(
        self, actor: int, prompts: list[list[int]], temperature: float, max_new_tokens: int, seed: int
    ):
        """Ref: actor `actor`'s completions of the canary prompts (`RolloutWorker.canary_completions`)."""
        return self.handles[actor].canary_completions.remote(prompts, temperature, max_new_tokens, seed)

    def canary(self, actors: list[int], pairs: list[tuple[list[int], list[int]]]) -> list:
        """Refs: each actor's teacher-forced logprobs of the canary pairs."""
        return [self.handles[i].canary_logprobs.remote(pairs) for i in actors]

    def sleep(self, level: int, timeout_s: float) -> float:
        """Put every engine to sleep (free its GPU memory); returns the slowest engine's seconds."""
        return max(
            get(
                [h.sleep.remote(level) for h in self.handles],
                timeout_s,
                "engine sleep",
                self.names(range(len(self.handles))),
            )
        )

    def wake(self, timeout_s: float) -> float:
        """Wake every engine; returns the slowest engine's seconds."""
        return max(
            get(
                [h.wake_up.remote() for h in self.handles],
                timeout_s,
                "engine wake-up",
                self.names(range(len(self.handles))),
            )
        )

    def busy_seconds(self) -> float | None:
        """Generation seconds summed over the serving actors (None: one did not answer in time)."""
        return self.members.busy_seconds()

    def rng_states(self, timeout_s: float = CONTROL_TIMEOUT_S) -> list:
        """Each serving actor's engine RNG state (a checkpoint's), None for one not serving, dead,
        frozen or silent past `timeout_s` (`actors.engine_rng.read_rng_states`: a named wait that
        never stops the run)."""
        return read_rng_states(self, timeout_s)

    def set_rng_states(self, states: list) -> None:
        """Restore `rng_states()` of a checkpoint taken with as many actors (else: nothing)."""
        if len(states) == len(self.handles):
            get(
                [h.set_rng_state.remote(s) for h, s in zip(self.handles, states)],
                CONTROL_TIMEOUT_S,
                "engine RNG restore",
            )
