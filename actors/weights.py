"""Weights from the trainer group to the engines, as one component: `WeightSync(cfg, trainers,
rollouts, transport, run, ...)` brings both groups up in the order their placement needs, forms
the weight-sync group, pushes every new version, re-forms the group when an engine dies or comes
back, and checks each sync with the canary (its tokens and bounds come from the first sync:
`rlcore.weights.canary`).

Over 400 lines: the bring-up order, the group's re-forming and the canary all act on one weight version.

The order of a sync's calls comes from the transport's own flags (`rlcore.transfer.base.Sender`):
a collective transport (`buffered` False: `broadcast`, `nccl`) has rank 0's rendezvous, and the
trainer's send and the engines' receive run together; a buffered one (`ipc`) has no process
group, and the engines read only after every rank has written (or the train step wrote it
already, `pushed`). With `every_rank` (`ipc`) each trainer rank writes a buffer that the engine
of the same index (on its GPU) opens; without it, every engine opens rank 0's. Start-up: `start` / `poll` / `join`. Split placement lets the engines start in the
background while the trainer starts and runs its SFT warm-up; the first sync waits for both.
Colocated placement (trainer rank i and engine i on GPU i) is this component's
business too: the engines start with the trainer when the plan fixed their cache bytes, else
before it (vLLM then sizes its memory from what is free at its start), and with a sleep level
they sleep while the trainer steps (`before_train` / `after_train`).
"""

from __future__ import annotations

import logging
import time

import ray

from actors.remote import ActorDied, ReadyWatch, RunError, get
from actors.rollout_group import RolloutGroup
from actors.run_state import RunState
from actors.stall_watch import BEFORE_SYNC_S
from actors.trainer_group import TrainerGroup
from rlcore.config import RunConfig
from rlcore.engine.registry import memory_budget, sleep_level
from rlcore.models.render import render_prompt
from rlcore.report.console import one_line
from rlcore.report.events import event
from rlcore.report.startup import Background, StartupPhases
from rlcore.transfer.base import Sender
from rlcore.transfer.plan import SyncPlan, plan_buckets
from rlcore.weights.canary import (
    CanaryBounds,
    CanaryError,
    calibrate,
    canary_prompts,
    compare_logprobs,
    own_completion_pairs,
)

log = logging.getLogger("rlcore")


def engines_sized_by_plan(cfg: RunConfig) -> bool:
    """Whether the rollout engines' memory is fixed by the config (the plan's cache budget,
    `rlcore.plan.memory.colocated_cache_bytes`, or the user's), not measured from the memory free
    at their start: then a colocated trainer rank may start and allocate while they start."""
    return memory_budget(cfg.rollout) is not None


class WeightSync:
    """`transport`: the run's sender class (its `buffered` / `every_rank` flags order the calls).
    `env`, `tokenizer`: where the canary's prompts come from. Sets `run.version` after a sync."""

    _group: tuple[str, int] | None = None
    """The collective transport's rendezvous of the group formed last (`_give_up` ends it)."""
    _canary: tuple | None = None
    """A canary started beside the next step, checked when the next sync starts
    (`rollout.canary_blocking` false): (version, actors, trainer refs, engine refs, start)."""
    _canary_waits = False
    """The next canary waits (the last one that ran beside a step failed)."""

    def __init__(
        self,
        cfg: RunConfig,
        trainers: TrainerGroup,
        rollouts: RolloutGroup,
        transport: type[Sender],
        run: RunState,
        env,
        tokenizer,
    ):
        self.cfg, self.trainers, self.rollouts, self.transport, self.run = cfg, trainers, rollouts, transport, run
        self.env, self.tokenizer = env, tokenizer
        self.timeout_s = cfg.rollout.weight_sync_timeout_s
        self.colocated = cfg.current_placement() == "colocated"
        self.sleep_level = sleep_level(cfg.rollout) if self.colocated else 0
        if self.sleep_level:  # the engine sleeping on each rank's GPU wakes into the memory a step used
            trainers.release_memory_after_steps()
        self.plan: SyncPlan | None = None
        self._canary_pairs: list[tuple[list[int], list[int]]] | None = None
        self.canary_bounds: CanaryBounds | None = None
        """Calibrated on the first sync that runs the canary; kept for the run's later syncs."""
        self._engines: ReadyWatch | None = None  # the engines' start (`start` .. `join`)
        self._background: Background | None = None  # its console phase when it runs meanwhile
        self._joined = False

    # -- start-up ------------------------------------------------------------------------------
    def teacher_starts_meanwhile(self) -> bool:
        """Whether a teacher may start while the engines and the trainer start: not on the GPUs a
        colocated trainer and engine share, where it sizes its memory from what they left."""
        return not (self.colocated and self.cfg.teacher.gpus_per_actor > 0)

    def start(self, startup: StartupPhases) -> None:
        """Start the trainer group while the engines start, in the order the placement needs, and
        plan the buckets; `join` then waits for the engines and forms the group.

        Split placement (trainer and engines on different devices): the engines' start (model
        load, vLLM's compile and graph capture) runs in the background through the trainer's
        start and the SFT warm-up (`poll` between its steps). Colocated: the same when the plan
        fixed the engines' cache bytes (`engines_sized_by_plan`); else one after the other,
        engines first, since vLLM then sizes its KV cache from the GPU memory free at its start."""
        n = len(self.rollouts)
        engines = f"starting the rollout engine{'s' if n > 1 else ''} ({self.cfg.rollout.engine})"
        self._engines = ReadyWatch(self.rollouts.handles, self.rollouts.timeout_s, "rollout actor")
        trainer = "starting the trainer and loading its model"
        if self.colocated and not engines_sized_by_plan(self.cfg):
            with startup.phase(engines):
                self._engines.join()
            self._announce()
        else:
            self._background = startup.background(engines)
            trainer += f" (concurrent with the engine{'s' if n > 1 else ''})"
        with startup.phase(trainer):
            metas = self.trainers.start()
        self.plan = plan_buckets(metas, int(self.cfg.rollout.sync_bucket_mb * 2**20))
        self.poll()

    def poll(self) -> bool:
        """Never blocks: whether the engines started by `start` are all up. An engine that died
        while starting is a RunError here, so the work done meanwhile (the SFT warm-up) never
        runs on to wait for it."""
        try:
            up = self._engines.poll()
        except RunError:
            if self._background is not None:
                self._background.failed()
            raise
        if up and self._background is not None and self._background.seconds is None:
            self._background.finish()
            self._announce()
        return up

    def join(self, startup: StartupPhases) -> None:
        """Wait for the engines still starting (once; later calls return at once) and form the
        weight-sync group: the first sync comes after both sides are up."""
        if self._joined:
            return
        if not self.poll():
            waited = time.perf_counter()
            try:
                self._engines.join()
            except RunError:
                self._background.failed()
                raise
            self._background.finish(time.perf_counter() - waited)
            self._announce()
        with startup.phase("joining the weight-sync group"):
            self.form()
        self._joined = True

    def _announce(self) -> None:
        """The engines' own start-up lines (the vLLM compile cache hit or missed), once."""
        for note in self.rollouts.startup_notes():
            print(f"rlcore: {note}", flush=True)

    def form(self, actors: list[int] | None = None) -> None:
        """(Re)build the weight-sync group: the trainer group plus the rollout actors `actors`
        (default: those serving). A collective transport gets a fresh rendezvous port (a group
        whose member died cannot be repaired, only replaced)."""
        actors = list(self.rollouts.serving) if actors is None else actors
        t, r = self.trainers, self.rollouts
        if self.transport.buffered:  # no process group: the engines open the trainer's buffers
            handles = get(t.init_weight_group("", 0, self.plan), self.timeout_s, "weight buffers (IPC) init", t.names)
            if not self.transport.every_rank:  # one sender (rank 0): every engine reads its buffer
                handles = [handles[0]] * len(r)
            get(
                r.open_buffers(actors, self.plan, handles),
                self.timeout_s,
                "weight receivers (IPC) init",
                r.names(actors),
            )
        elif actors:
            address, port = t.weight_address()
            self._group = (address, port)
            get(
                t.init_weight_group(address, port, self.plan, len(actors))
                + r.join_group(actors, address, port, self.plan),
                self.timeout_s,
                "weight group init",
                t.names + r.names(actors),
            )
        self.rollouts.group_formed()

    # -- around a train step (the hybrid schedule of a colocated run) --------------------------
    def before_train(self) -> dict[str, float]:
        """With a sleep level, the engines free the GPU for the train step (`sleep_s`); else {}."""
        return {"sleep_s": self.rollouts.sleep(self.sleep_level, self.timeout_s)} if self.sleep_level else {}

    def after_train(self) -> dict[str, float]:
        """With a sleep level, the engines wake before the sync refills them (`wake_s`); else {}."""
        return {"wake_s": self.rollouts.wake(self.timeout_s)} if self.sleep_level else {}

    # -- syncs ---------------------------------------------------------------------------------
    def sync(self, version: int) -> dict[str, float]:
        """Push the trainer's weights to every serving engine as `version`; returns timing
        metrics. An engine that died leaves (the group is re-formed from the others, and the
        sync retried once); nothing waits for its restart. When the step already wrote `version`
        into the transport's buffers (`TrainerGroup.take_pushed`), only the engines read them."""
        self.rollouts.watch(BEFORE_SYNC_S)  # an engine frozen now would hold the collective: it leaves first
        return self._reform_and_sync(
            version, self.rollouts.serving, self.rollouts.needs_reform, self.trainers.take_pushed(version)
        )

    def admit_restarted(self) -> list[int]:
        """Call only while no train step runs (the trainer must join the group). Restarted
        actors whose constructor has run join a re-formed group, receive the current version
        and serve again; returns them. Nothing waits for one still starting."""
        ready = self.rollouts.poll()
        if not ready:
            return []
        version = self.run.version
        self.rollouts.watch(BEFORE_SYNC_S)
        self._reform_and_sync(version, sorted(self.rollouts.serving + ready))
        stalled = {i for i in ready if self.rollouts.members.back_from_stall(i)}
        joined = self.rollouts.admit(ready)
        for why, group in (
            ("after a restart", [i for i in joined if i not in stalled]),
            ("after it stalled (it answers again)", [i for i in joined if i in stalled]),
        ):
            if group:
                log.warning(
                    "rollout actor%s %s rejoined the weight group at version %d %s",
                    "s" if len(group) > 1 else "",
                    ", ".join(map(str, group)),
                    version,
                    why,
                    extra=event(
                        "rollout_rejoined",
                        actors=group,
                        version=version,
                        step=self.run.step,
                        stalled=bool(set(group) & stalled),
                    ),
                )
        return joined

    def _reform_and_sync(
        self, version: int, actors: list[int], reform: bool = True, pushed: list[dict] | None = None
    ) -> dict[str, float]:
        """(Re-form the group of `actors` and) sync `version` to them. A failure retries once
        without the engines that no longer answer; a trainer rank's death stops the run."""
        for attempt in (1, 2):
            try:
                if reform:
                    self.form(actors)
                return self._sync(version, actors, pushed)
            except RunError as exc:
                self._give_up()
                if attempt == 2 or (isinstance(exc, ActorDied) and any(d.startswith("trainer") for d in exc.dead)):
                    raise  # only engines can be replaced
                # engines the failed call saw die need no probe: a restarting actor answers the
                # probe only once Ray has rebuilt it, so probing it costs the probe's whole 10 s
                died = [i for i in actors if isinstance(exc, ActorDied) and f"rollout actor {i}" in exc.dead]
                # after a frozen engine, nor do those answering the stall watch's heartbeats (under load
                # the probe's 10 s can pass for an engine that is alive, which then left for nothing);
                # after a death, a heartbeat answered seconds ago says nothing: they are probed
                stall = isinstance(exc, ActorDied) and exc.how == "made no progress"
                dead = died + self.rollouts.dead_engines(
                    [i for i in actors if i not in died and not (stall and self.rollouts.stalls.answering(i))]
                )
                # one line: the message may hold a remote traceback (the whole text is for a fatal error)
                what = one_line(str(exc))
                if not what.startswith("weight sync"):
                    what = f"weight sync to version {version}: {what}"
                log.warning(
                    "%s; %s",
                    what,
                    f"rollout actor(s) {dead} left, re-forming the weight group without them"
                    if dead
                    else "rebuilding the weight group",
                )
                for i in dead:
                    self.rollouts.engine_lost(i, float("inf"), exc.how if i in died else None)
                actors, reform = [i for i in actors if i not in dead], True
        raise AssertionError("unreachable")

    def _give_up(self) -> None:
        """The members still waiting in the failed operation (the trainer's send or rendezvous,
        the engines that answer) give it up now (`Sender.abort`) instead of at its deadline: the
        trainer rank is then free for the re-formed group's calls, which Ray queues behind it."""
        if self._group is not None:
            if not self.transport.abort(*self._group):
                log.debug("weight group %s:%d: abort not delivered", *self._group)
            self._group = None

    def _send(self, version: int, actors: list[int], pushed: list[dict] | None) -> list[dict]:
        """The trainer ranks' then the engines' results of one sync, in the transport's order."""
        t, r, what = self.trainers, self.rollouts, f"weight sync to version {version}"
        if not self.transport.buffered:  # collective: both sides must be in the call at once
            return get(t.push() + r.pull(actors, version), self.timeout_s, what, t.names + r.names(actors), r.frozen)
        if pushed is None:  # the ranks' gathers are collective: all of them fill their buffers at once
            pushed = get(t.push(), self.timeout_s, f"{what} (trainer buffers)", t.names)
        return pushed + get(r.pull(actors, version), self.timeout_s, f"{what} (engines)", r.names(actors), r.frozen)

    def _sync(self, version: int, actors: list[int], pushed: list[dict] | None = None) -> dict[str, float]:
        start = time.perf_counter()
        if not actors:  # no engine serves: the one that joins next receives the trainer's weights then
            self.run.version = version
            return {"sync_time_s": 0.0, "sync_gb_per_s": 0.0, "sync_send_s": 0.0}
        # the last sync's canary first: engines must still hold the version it scores. If it
        # failed, the sync is retried (`_reform_and_sync`) with a canary that waits, as a failed
        # canary that waited is: a sync broken every time still stops the run
        try:
            canary = self.finish_canary()
        except RunError:
            self._canary_waits = True
            raise
        try:
            out = self._send(version, actors, pushed)
        except ray.exceptions.RayTaskError as exc:
            raise RunError(f"weight sync to version {version} failed: {exc}") from exc
        self.run.version = version
        self.rollouts.release(actors, version)  # disaggregated: both pools hold it, prefills of it decode
        elapsed = time.perf_counter() - start
        sent = out[0]["sync_bytes"]
        metrics = {
            "sync_time_s": elapsed,
            "sync_gb_per_s": sent / max(elapsed, 1e-9) / 1e9,
            "sync_send_s": out[0]["sync_send_s"],
            # the send ran inside the train step (buffered transport): sync_time_s is the receive alone
            "sync_in_step": float(pushed is not None),
        }
        engine = out[len(self.trainers)]
        metrics.update({k: float(v) for k, v in engine.items() if k in ("sync_engine_s", "sync_worker_s")})
        metrics.update(canary)
        metrics.update(self.check_canary(version, actors))
        return metrics

    # -- the canary ----------------------------------------------------------------------------
    def canary_pairs(self, actor: int) -> list[tuple[list[int], list[int]]]:
        """The canary's tokens, made once: greedy and sampled completions by engine `actor` of the
        environment's first eval prompts (`rlcore.weights.canary.own_completion_pairs`); random ids only
        where tasks carry images (image tokens need pixel values to score) or nothing came back."""
        if self._canary_pairs is None:
            r = self.cfg.rollout
            n = r.canary_prompts
            tasks = (
                []
                if self.env.uses_images
                else [self.env.make_task(i, "eval") for i in range(min(n, self.env.eval_size))]
            )
            prompts = [render_prompt(self.tokenizer, t.messages) for t in tasks]

            def generate(batch, temperature, max_new_tokens, seed):
                ref = self.rollouts.canary_completions(actor, batch, temperature, max_new_tokens, seed)
                return get([ref], r.generate_timeout_s, "canary completions", self.rollouts.names([actor]))[0]

            pairs = (
                own_completion_pairs(
                    prompts, generate, r.canary_tokens, r.sampling.temperature, seed=self.cfg.seed + 1234
                )
                if prompts
                else []
            )
            if not pairs:
                vocab_size = next(
                    m.shape[0] for b in self.plan.buckets for m in b.metas if m.name.endswith("embed_tokens.weight")
                )
                pairs = canary_prompts(
                    vocab_size, num_prompts=n, completion_len=-(-r.canary_tokens // n), seed=self.cfg.seed + 1234
                )
            self._canary_pairs = pairs
        return self._canary_pairs

    def check_canary(self, version: int, actors: list[int]) -> dict[str, float]:
        """After a sync, every engine's teacher-forced logprobs on the canary's tokens must match
        the trainer's within the bounds the first sync calibrated (a stale, partial or mis-mapped
        sync shows as whole nats of gap); the first sync sets them (one console line). Later
        canaries of an asynchronous run go beside the next step and `finish_canary` checks them
        (returns {} then), unless `rollout.canary_blocking`, engines that sleep, or a failed one
        make this one wait."""
        r = self.cfg.rollout
        if r.canary_prompts <= 0:
            return {}
        start = time.perf_counter()
        pairs = self.canary_pairs(actors[0])
        # both sides at once: the sync already finished, so each scores the same version (a
        # trainer rank runs its calls in order: its canary comes before the next step's)
        pending = (version, actors, self.trainers.canary(pairs), self.rollouts.canary(actors, pairs), start)
        # a synchronous run's next step generates at once: its canary waits, so the engines serve
        # nothing else meanwhile and a run and its resume stay exact (evaluations included)
        beside = self.cfg.algo.max_off_policy_steps > 0 and not (r.canary_blocking or self.sleep_level)
        if self.canary_bounds is not None and beside and not self._canary_waits:
            self._canary = pending  # checked by `finish_canary` when the next sync starts
            return {}
        metrics = self._check(*pending)
        self._canary_waits = False
        return metrics

    def finish_canary(self) -> dict[str, float]:
        """Check the canary started beside the last step, if any (its metrics; {} if none). A
        broken sync raises RunError here: at the next sync, or when the run ends."""
        pending, self._canary = self._canary, None
        if pending is None:
            return {}
        version, actors, trainer_refs, engine_refs, _ = pending
        # an engine that left the serving set since (dead, frozen) is not waited for
        serving = set(self.rollouts.serving)
        kept = [(i, ref) for i, ref in zip(actors, engine_refs) if i in serving]
        if not kept:
            return {}
        # canary_time_s: what the driver waited for it, not the step it ran beside
        return self._check(version, [i for i, _ in kept], trainer_refs, [ref for _, ref in kept], time.perf_counter())

    def drop_canary(self) -> None:
        """Forget a canary still running (the trainer ranks that owe its answer died)."""
        self._canary = None

    def _check(
        self, version: int, actors: list[int], trainer_refs: list, engine_refs: list, start: float
    ) -> dict[str, float]:
        r = self.cfg.rollout
        trainer = get(trainer_refs, self.timeout_s, "canary (trainer)", self.trainers.names)[0]
        engines = get(
            engine_refs, self.timeout_s, "canary (engines)", self.rollouts.names(actors), self.rollouts.frozen
        )
        if self.canary_bounds is None:
            measured = [compare_logprobs(engine, trainer, raise_on_fail=False) for engine in engines]
            try:
                self.canary_bounds = calibrate(
                    measured, r.canary_multiple, r.canary_floor, r.canary_max_floor, r.canary_calibration_limit
                )
            except CanaryError as exc:
                raise RunError(f"canary after sync to version {version}: {exc}") from exc
            b = self.canary_bounds
            log.info(
                "canary calibrated on the sync to version %d: later syncs must keep %s (rollout.canary_multiple=%g, "
                "canary_floor=%g, canary_max_floor=%g); token_mult_prob_error %.5f",
                version,
                b.describe(),
                r.canary_multiple,
                r.canary_floor,
                r.canary_max_floor,
                b.baseline_mult_prob_error,
            )
            if r.max_mismatch is not None and b.baseline_mult_prob_error > r.max_mismatch:
                raise RunError(
                    f"engine/trainer mismatch on the same weights: token_mult_prob_error "
                    f"{b.baseline_mult_prob_error:.5f} over {b.num_tokens} tokens of the policy's own "
                    f"completions passes rollout.max_mismatch={r.max_mismatch} (python -m rlcore.mismatch "
                    f"measures it alone)"
                )
        worst = None
        for i, engine in zip(actors, engines):
            try:
                res = self.canary_bounds.check(engine, trainer)
            except CanaryError as exc:
                raise RunError(
                    f"canary after sync to version {version}, rollout actor {i}: {exc} "
                    f"(bounds calibrated on the first sync: {self.canary_bounds.describe()})"
                ) from exc
            if worst is None or res.max_gap > worst.max_gap:
                worst = res
        return {
            "canary_max_gap": worst.max_gap,
            "canary_mean_gap": worst.mean_gap,
            **self.canary_bounds.metrics(),
            "canary_time_s": time.perf_counter() - start,
            "canary_version": version,
        }
