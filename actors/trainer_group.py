"""The trainer group: the one place that holds the trainer ranks' handles, names ("trainer rank i")
and deadline (`trainer.step_timeout_s`), and makes the calls that run on every rank at once.

Over 400 lines: every call made on all ranks at once shares the ranks' names and deadline kept here.

The RL driver, its warm-up and the SFT driver use it alike: `start` (rendezvous on rank 0,
process-group init, parameter metadata), `launch_step` / `finish_step` (a train step the driver's
event loop waits on without blocking), `step`, `sft_step`, `save` / `load` / `export`,
`last_step_logprobs` (what the last step computed, for the samples table: no collective), and for
`WeightSync` the weight-group calls (`init_weight_group`, `push`, `canary`), which return refs
so the sync can wait on the trainer's and the engines' halves together. `restart` kills the ranks
and starts new ones in the same placement group bundles. Every blocking call has the group's
deadline and names the rank that died or failed (`actors.remote.get`).
"""

from __future__ import annotations

import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import ray
from ray.util.placement_group import placement_group_table
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.actor_config import config_env, remote_class
from actors.remote import WAIT_NOTICE_S, ActorDied, RunError, get, refs_ready
from actors.session import CapacityProbe
from actors.trainer import TrainerRank
from rlcore.config import ClusterConfig, RunConfig
from rlcore.plan.layout import Bundle
from rlcore.report.console import log_error_detail
from rlcore.report.events import event
from rlcore.storage.checkpoint import CheckpointWriter
from rlcore.storage.errors import NO_SPACE, storage_cause
from rlcore.storage.location import is_remote
from rlcore.storage.staging import NoAnswer
from rlcore.transfer.plan import SyncPlan, TensorMeta

log = logging.getLogger("rlcore")

CLOSE_TIMEOUT_S = 30.0
"""How long closing the ranks' process groups may take on the way out (best effort)."""


@dataclass
class TrainResult:
    """A finished train step: rank 0's metrics (with `version`)."""

    metrics: dict[str, Any]

    @property
    def version(self) -> int:
        return int(self.metrics["version"])


class TokenDataLost(Exception):
    """A step's groups whose token data can no longer be read (`actors.trainer.fetch_token_data`):
    `refs`, their data refs; `why`, how it was lost. The step was not trained; the caller drops
    them and steps again."""

    def __init__(self, refs: list, why: str = "lost with the node that made it"):
        super().__init__(f"{len(refs)} group(s)' token data {why}")
        self.refs, self.why = refs, why


class TrainerGroup:
    """The trainer ranks of one run, created in placement group `pg` (bundle i holds rank i, the
    plan's `bundles`: what a restart must find room for again), each asking for `gpus_per_rank` GPUs."""

    def __init__(self, cfg: RunConfig, pg, gpus_per_rank: float, bundles: list[Bundle]):
        self.cfg, self.pg, self.gpus_per_rank, self.bundles = cfg, pg, gpus_per_rank, bundles
        self.timeout_s = cfg.trainer.step_timeout_s
        self.names = [f"trainer rank {i}" for i in range(cfg.trainer.world_size)]
        self._release_memory = False  # `release_memory_after_steps`
        self._pushed: tuple[int, list[dict]] | None = None  # (version, push results): `take_pushed`
        self._works: list = []  # the RankWork of the step launched last, per rank
        self.placed: list[str] = []
        """The Ray node id of each rank's bundle when the ranks last started (`nodes` reads where
        the bundles are now: after a node's death Ray may have moved them already)."""
        self.handles = self._spawn()

    def __len__(self) -> int:
        return len(self.handles)

    def _spawn(self) -> list:
        t = self.cfg.trainer
        cls = remote_class(TrainerRank)  # the config travels in the runtime_env (`actors.actor_config`)
        return [
            cls.options(
                num_cpus=t.cpus_per_rank,
                num_gpus=self.gpus_per_rank,
                runtime_env=config_env(self.cfg, t.env_vars),
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=i),
            ).remote(i, t.world_size)
            for i in range(t.world_size)
        ]

    def _each(self, method: str, *args) -> list:
        return [getattr(h, method).remote(*args) for h in self.handles]

    def _get(self, refs: list, what: str) -> list:
        return get(refs, self.timeout_s, what, self.names)

    # -- start / restart -----------------------------------------------------------------------
    def start(self, first_answer_s: float | None = None) -> list[TensorMeta]:
        """Rendezvous on rank 0, init the process group on every rank (each builds or loads its
        model), and return the parameters' metadata (what a weight-sync plan is made from).
        `first_answer_s`: how long rank 0 may take to be created and answer (default: the group's
        deadline)."""
        addr, port = get(self.handles[0].address.remote(), first_answer_s or self.timeout_s, "trainer rank 0 start")
        self._get(self._each("init_distributed", addr, port), "trainer process-group init")
        metas = get(self.handles[0].parameter_metas.remote(), self.timeout_s, "parameter metadata")
        self.placed = self.nodes()
        return [TensorMeta(n, tuple(s), d) for n, s, d in metas]

    def restart(self, step: int | None = None) -> list[TensorMeta]:
        """Kill every rank (a dead one included) and start new ones in the same bundles, then
        `start` them: the new ranks hold the initial model (`model.path` or random weights);
        load a checkpoint to continue, and re-form the weight group (the old one had the dead
        ranks). Returns the parameters' metadata.

        A dead node's bundles are rescheduled by Ray on the resources left (or on the node once
        it is back), but only after Ray has marked the node dead: until then the placement group
        still looks ready there and new ranks die again (or never start). So the start is retried
        until it succeeds, within `cluster.placement_timeout_s` from the first attempt; one log
        line (and timeline event, after `step` steps) names the nodes the ranks run on."""
        self._pushed = None  # the dead group's buffers are gone with it
        wait_s = self.cfg.cluster.placement_timeout_s
        before = self.placed or self.nodes()
        began = time.monotonic()
        deadline, attempt = began + wait_s, 0
        capacity = CapacityWatch(self.cfg.cluster, self.bundles, "trainer restart", wait_s)
        while True:
            attempt += 1
            self.kill()
            ready = capacity.wait_ready(self.pg, deadline)
            if not ready:
                raise RunError(
                    f"trainer restart: {capacity.gone or 'the trainer placement group was not scheduled again'}"
                    f"; no node joined within cluster.placement_timeout_s={wait_s:g}s"
                    + ("" if capacity.gone else f"; cluster has {ray.available_resources()}")
                )
            self.handles = self._spawn()
            try:
                metas = self.start(first_answer_s=max(1.0, deadline - time.monotonic()))
            except RunError as exc:
                capacity.check()
                if time.monotonic() >= deadline:
                    if capacity.gone:
                        raise RunError(
                            f"trainer restart: {capacity.gone}; no node joined within "
                            f"cluster.placement_timeout_s={wait_s:g}s"
                        ) from exc
                    raise RunError(
                        f"trainer restart: the new ranks did not start within "
                        f"cluster.placement_timeout_s={wait_s:g}s ({attempt} attempt(s)): {exc}"
                    ) from exc
                log.info("trainer restart attempt %d failed (%s); retrying", attempt, str(exc).splitlines()[0][:200])
                time.sleep(min(2.0, max(0.0, deadline - time.monotonic())))
                continue
            after = self.nodes()
            log.warning(
                "trainer restart: %d rank(s) %s (%d attempt(s), %.1fs)",
                len(self.handles),
                placement_change(before, after),
                attempt,
                time.monotonic() - began,
                extra=event(
                    "trainer_restart",
                    moved=sorted(set(before)) != sorted(set(after)),
                    nodes=sorted({n[:8] for n in after if n}),
                    step=step,
                ),
            )
            return metas

    @staticmethod
    def dead_nodes(nodes: list[str]) -> list[str]:
        """The nodes (short ids) of `nodes` that Ray no longer lists as alive."""
        alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        return sorted({n[:8] for n in nodes if n and n not in alive})

    def nodes(self) -> list[str]:
        """The Ray node id of each rank's bundle, in rank order (where Ray has placed it now)."""
        where = placement_group_table(self.pg)["bundles_to_node_id"]
        return [where.get(i, "") for i in range(len(self.handles))]

    def load_engine_weights(self, weights_ref, version: int) -> int:
        """Every rank takes the engine's weights (`weights_ref`: a `RolloutWorker.state_dict`
        ref, read by each rank from the object store) as policy `version`, with a fresh optimizer
        state; returns the version."""
        return int(
            self._get(
                self._each("load_engine_weights", weights_ref, version),
                f"loading the engines' weights (version {version})",
            )[0]
        )

    # -- steps ---------------------------------------------------------------------------------
    def launch_step(self, works: list, normalizer: float) -> list:
        """Start one RL optimizer step: rank i trains on `works[i]` (`rlcore.batch.step.RankWork`).
        Returns the refs to wait on (`step_done`, `finish_step`)."""
        self._works = works  # `finish_step` names the groups a rank could not read
        return [h.train_step.remote(w, normalizer, self._release_memory) for h, w in zip(self.handles, works)]

    def release_memory_after_steps(self) -> None:
        """From now on each rank hands its cached GPU memory back after a step: the placement
        (`WeightSync`, an engine asleep on the same GPU) asks for it."""
        self._release_memory = True

    @staticmethod
    def step_done(refs: list) -> bool:
        """Never blocks: whether every rank of a launched step has answered."""
        return refs_ready(refs)

    def finish_step(self, refs: list, step: int) -> TrainResult:
        """The result of the launched step `step` (1-based, for messages); `TokenDataLost` when
        some of its groups' token data was lost (then no rank trained: the weights are as before)."""
        results = self._get(refs, f"train step {step}")
        if any("token_data_lost" in r for r in results):  # no rank trained (they agreed first)
            raise TokenDataLost(
                [self._works[rank].data[i] for rank, r in enumerate(results) for i in r.get("token_data_lost", [])],
                next((r["token_data_lost_why"] for r in results if r.get("token_data_lost_why")), "lost"),
            )
        # a buffered transport: the step also wrote the new weights into the buffers; kept here for
        # the sync (`take_pushed`), which then only has the engines read them
        pushed = [r.pop("weights_pushed") for r in results] if "weights_pushed" in results[0] else None
        self._pushed = (int(results[0]["version"]), pushed) if pushed is not None else None
        return TrainResult(results[0])

    def last_step_logprobs(self, keys: list[tuple[int, int]], version: int) -> dict[tuple[int, int], list[float]]:
        """The trainer logprobs of the samples of `keys` from the step that made `version`, along
        their packed positions (`TrainerRank.last_step_logprobs`), from whichever rank held each
        (context-parallel ranks share their work: any one of them will do). No collective; the
        group's deadline. A display's read: a rank that fails or does not answer leaves them out
        ({}, with a warning), never the run (a dead rank is met by the next step)."""
        if not keys:
            return {}
        try:
            answers = self._get(
                self._each("last_step_logprobs", keys, version), f"trainer logprobs of version {version}"
            )
        except (RunError, ray.exceptions.RayError) as exc:
            log.warning("samples table without trainer logprobs: %s", str(exc).splitlines()[0][:300])
            return {}
        merged: dict[tuple[int, int], list[float]] = {}
        for answer in answers:
            merged.update(answer)
        return merged

    def take_pushed(self, version: int) -> list[dict] | None:
        """Every rank's push result when the last finished step wrote `version` into the
        transport's buffers; None otherwise (another version, a restart since, or taken already)."""
        held, self._pushed = self._pushed, None
        return held[1] if held is not None and held[0] == version else None

    def step(self, works: list, normalizer: float, step: int) -> TrainResult:
        """`launch_step` then `finish_step` (blocking)."""
        return self.finish_step(self.launch_step(works, normalizer), step)

    def sft_step(self, shards: list, loss_tokens: int, what: str) -> dict[str, Any]:
        """One supervised optimizer step: rank i takes `shards[i]`; `loss_tokens` is the batch's
        loss-token count over all ranks. Returns rank 0's metrics (with `version`)."""
        refs = [h.sft_step.remote(ray.put(shard), loss_tokens) for h, shard in zip(self.handles, shards)]
        return self._get(refs, what)[0]

    # -- weight sync (refs: the sync waits on them together with the engines' calls) -----------
    def weight_address(self) -> tuple[str, int]:
        """Where rank 0 hosts a weight-group rendezvous (a fresh port per call)."""
        return get([self.handles[0].address.remote()], self.timeout_s, "weight group address", self.names[:1])[0]

    def init_weight_group(self, address: str, port: int, plan: SyncPlan, engines: int | None = None) -> list:
        """Every rank's `TrainerRank.init_weight_group` call (refs)."""
        return self._each("init_weight_group", address, port, plan, engines)

    def push(self) -> list:
        """Every rank's `push_weights` call (refs): gather the full weights and send them."""
        return self._each("push_weights")

    def canary(self, pairs: list[tuple[list[int], list[int]]]) -> list:
        """Every rank's `canary_logprobs` call (refs; collective: rank 0's answer is the group's)."""
        return self._each("canary_logprobs", pairs)

    # -- checkpoints and export ----------------------------------------------------------------
    def save(self, writer: CheckpointWriter, step: int, driver_state: Callable[[], dict[str, Any]]) -> Path:
        """Write the checkpoint of `step`: every rank's shard into the writer's temporary folder,
        then the driver's state (`driver_state()`, taken after the shards) and the commit. Any
        failure removes the partial folder and raises RunError naming the step and the folder. It
        is "saved" only once the driver sees every rank's part on the storage (`writer.commit`)."""
        start = time.perf_counter()
        tmp = None
        try:
            tmp = writer.begin(step)
            parts: dict[str, int] = {}
            refs = self._each("save_checkpoint", str(tmp))
            for rank_parts in get(
                refs,
                self.cfg.checkpoint.timeout_s,
                f"checkpoint save of step {step}",
                self.names,
                notice=f"writing to {writer.root}, checkpoint.timeout_s",
            ):
                parts.update(rank_parts or {})
            path = writer.commit(tmp, step, driver_state(), parts)
        except BaseException as exc:
            cause = save_failure_cause(exc, writer.root) if isinstance(exc, Exception) else None
            if tmp is not None and not isinstance(exc, NoAnswer):  # a store that did not answer: not asked again
                writer.abort(tmp)
            if cause is not None:  # a storage fault: named in a short first line, the whole error in the log
                line = f"checkpoint save of step {step} to {writer.root} failed: {cause}"
                log_error_detail(self.cfg.output_dir, f"{line}\n{exc}")
                raise RunError(line) from exc
            if isinstance(exc, RunError):
                raise
            if isinstance(exc, Exception):
                raise RunError(f"checkpoint save of step {step} to {writer.root} failed: {exc}") from exc
            raise
        log.info("checkpoint %s saved in %.1fs", path, time.perf_counter() - start)
        return path

    def load(self, path: Path | str) -> int:
        """Load a checkpoint saved at any trainer world size on every rank; returns its version."""
        return int(self._get(self._each("load_checkpoint", str(path)), f"loading checkpoint {path}")[0])

    def export(self) -> str:
        """Write the current weights as a Hugging Face folder (`checkpoint.export_dir`, default
        OUTPUT_DIR/hf); returns it."""
        out = self.cfg.checkpoint.export_dir or str(Path(self.cfg.output_dir) / "hf")
        self._get(self._each("export_hf", out), f"export to {out}")
        log.info("exported the final weights to %s", out)
        return out

    # -- the way out ---------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Close the ranks' process groups (best effort: this runs on the way out, also after a
        fault), then kill them."""
        try:
            ray.get(self._each("shutdown"), timeout=CLOSE_TIMEOUT_S)
        except Exception:
            pass
        self.kill()

    def kill(self) -> None:
        for h in self.handles:
            ray.kill(h, no_restart=True)


class CapacityWatch:
    """Whether the alive nodes can still host the trainer group (`rlcore.plan.node_fit.
    capacity_gone`: a node lost with no replacement), asked while a restart waits: said in one
    line at once (`gone` keeps it), the wait goes on until its deadline for a node to join."""

    def __init__(self, cluster: ClusterConfig, bundles: list[Bundle], what: str, wait_s: float):
        self.what, self.wait_s = what, wait_s
        self.gone: str | None = None
        self.probe = CapacityProbe(cluster, bundles)  # never blocks (a slow GCS)

    def check(self) -> str | None:
        gone = self.probe()
        if gone and gone != self.gone:
            log.warning(
                "%s: %s; waiting up to %.0fs (cluster.placement_timeout_s) for such a node to join",
                self.what,
                gone,
                self.wait_s,
                extra=event("capacity_gone", group="trainer"),
            )
        self.gone = gone
        return gone

    def wait_ready(self, pg, deadline: float) -> bool:
        """Wait for `pg` until `deadline` (monotonic), checking the capacity every `CAPACITY_BEAT_S`."""
        ref, start, said = pg.ready(), time.monotonic(), False
        while True:
            left = deadline - time.monotonic()
            ready, _ = ray.wait([ref], timeout=max(0.0, min(CAPACITY_BEAT_S, left)))
            if ready:
                return True
            if left <= CAPACITY_BEAT_S:
                return False
            if not self.check() and not said and time.monotonic() - start >= WAIT_NOTICE_S:
                said = True
                log.warning(
                    "%s: waiting for Ray to place the trainer group's bundles again; up to %.0fs more "
                    "(cluster.placement_timeout_s)",
                    self.what,
                    max(0.0, deadline - time.monotonic()),
                )


CAPACITY_BEAT_S = 2.0
"""How often a restart's wait asks whether any alive node can host the group."""

LOW_SPACE_BYTES = 16 << 20
"""Free bytes under which a failed local checkpoint write is read as a full disk (torch's zip
writer reports a short write as `unexpected pos ...`, without the errno)."""


def save_failure_cause(exc: BaseException, root) -> str | None:
    """The storage cause of a failed checkpoint save (`rlcore.storage.errors.storage_cause`: no
    space, permission, unreachable, throttled), or None for another fault. On a local folder, a
    write error with no cause in its text while the disk is (nearly) full reads as "no space left
    on device" (asked before the partial folder is removed)."""
    cause = storage_cause(exc)
    if cause is not None or isinstance(exc, ActorDied):
        return cause
    if is_remote(root):
        return None
    try:
        free = shutil.disk_usage(str(root)).free
    except OSError:
        return None
    return NO_SPACE if free < LOW_SPACE_BYTES else None


def placement_change(before: list[str], after: list[str]) -> str:
    """How a restart's ranks were placed against where they ran before (short node ids)."""

    def ids(nodes: list[str]) -> str:
        return ", ".join(sorted({n[:8] for n in nodes if n}))

    if sorted(set(before)) == sorted(set(after)):
        return f"back on the same node(s) {ids(after)}"
    return f"re-placed from node(s) {ids(before)} on node(s) {ids(after)}"
