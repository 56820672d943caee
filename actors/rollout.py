"""Rollout actor: an inference engine plus the environment's episode loop, served to the driver.

Threaded (several calls at once): `generate_groups` calls run while `pull_weights` receives a new
policy, which the engine swaps in between two decode steps.
"""

from __future__ import annotations

import dataclasses
import os
import traceback
import warnings
from typing import TYPE_CHECKING

import ray

from actors.logs import redirect_output
from actors.pd_router import PrefillBehind, PrefillNotServing, PrefillRouter
from rlcore.batch.meta import samples_meta
from rlcore.config import RunConfig
from rlcore.engine.base import SamplingParams
from rlcore.engine.registry import make_engine, prestart_engine, tensor_parallel_size, weight_transport
from rlcore.engine.slots import GenerationSlots, RequestLimits
from rlcore.envs import build_env
from rlcore.isolation.safety import threads_abandoned
from rlcore.models.tokenizer_build import build_tokenizer
from rlcore.plan.pd import connector_env, pool_config
from rlcore.report.busy import BusyClock
from rlcore.report.faults import NotInWeightGroup
from rlcore.report.profiling import prime_profiler, source_info
from rlcore.transfer import first_rank, make_receiver, transfer_options, world_size
from rlcore.transfer.plan import SyncPlan
from rlcore.types import Group, Sample, SampleMeta, Task
from rlcore.weights.protocol import Receiver

if TYPE_CHECKING:
    import torch


def meta_reply(groups: list[Group]) -> tuple[list[list[SampleMeta]], dict]:
    """What the driver keeps of a request: each group's sample metadata, and the environment's
    health as the actor saw it (`generate_groups` gives every group the same stats)."""
    return [samples_meta(g.samples) for g in groups], (groups[0].env_stats if groups else {})


def failed_groups(tasks: list[Task], group_size: int, error: str) -> list[Group]:
    """Placeholder groups for a request that failed as a whole, so its samples are counted."""
    return [
        Group(
            task=t,
            samples=[
                Sample([], [], [], [], [], finish_reason="abort", failed=True, error=error) for _ in range(group_size)
            ],
        )
        for t in tasks
    ]


class RolloutWorker:
    """Rollout actor `index` of pool `role` (`rlcore.plan.pd.rollout_pools`): `rollout` (no
    disaggregation), `decode` (runs the episodes; each generate call prefills on one of the
    prefill actors named `prefill_actors` (Ray actor names; `prefill_names`: how logs name them)
    through its `PrefillRouter`) or `prefill` (serves `prefill` calls only)."""

    def __init__(
        self,
        cfg: RunConfig,
        index: int,
        role: str = "rollout",
        prefill_actors: list[str] | None = None,
        prefill_names: list[str] | None = None,
    ):
        redirect_output(cfg.output_dir, "rollout", index)
        os.environ.update(connector_env(cfg, index))  # before the engine (and its prestarted core) reads it
        cfg = pool_config(cfg, role)  # a prefill actor's engine: the prefill pool's GPUs and TP
        prestart_engine(cfg.rollout)  # first: it overlaps what follows (vLLM: its engine core's imports)
        self.cfg, self.index, self.role = cfg, index, role
        import torch

        torch.set_num_threads(max(1, int(cfg.rollout.cpus_per_actor)))
        self.tokenizer = build_tokenizer(cfg.model)
        if cfg.profile.steps:  # Kineto first starts here, where torch was imported, not on a request's thread
            prime_profiler()
        self.engine = make_engine(
            cfg, self.tokenizer, seed=cfg.seed * 1000 + index, pd_role=role if role != "rollout" else None
        )
        # a restarted prefill actor serves no prefill until it holds the run's weights again
        with warnings.catch_warnings():  # Ray's own property reads its deprecated `actor_id`: every log said so
            warnings.simplefilter("ignore", DeprecationWarning)
            self.has_weights = not ray.get_runtime_context().was_current_actor_reconstructed
        self.prefills = 0  # prefill calls served (a prefill actor)
        serve = self.engine
        if role == "decode":
            serve = self.router = PrefillRouter(
                self.engine,
                prefill_actors or [],
                prefill_names or [],
                cfg.rollout.pd,
                cfg.rollout.generate_timeout_s,
                cfg.rollout.weight_sync_timeout_s,
            )
        # requests generate in at most `slots` at once; their scoring holds none
        self.slots = GenerationSlots(serve, RequestLimits.of(cfg.rollout).slots)
        self.env = build_env(cfg.env)
        s = cfg.rollout.sampling
        self.params = SamplingParams(max_new_tokens=s.max_new_tokens, temperature=s.temperature, top_p=s.top_p)
        self.receiver: Receiver | None = None
        self.clock = BusyClock()

    def ready(self) -> int:
        return self.index

    def startup_note(self) -> str | None:
        """The engine's line about its start (vLLM: whether its compile cache was hit), or None."""
        return getattr(self.engine, "startup_note", None)

    def init_weight_group(
        self,
        address: str,
        port: int,
        plan: SyncPlan,
        handle: dict | None = None,
        slot: int | None = None,
        engines: int | None = None,
    ) -> bool:
        """Join the weight-sync group in `slot` of its `engines` actors (default: this actor's
        index of all; the trainer's rank 0 joins at the same time); colocated, keep the IPC
        `handle` of the trainer rank on this GPU instead."""
        name, workers = weight_transport(self.cfg), tensor_parallel_size(self.cfg.rollout)
        rank = first_rank(name, self.index if slot is None else slot, workers)
        size = world_size(name, self.cfg.rollout.num_actors if engines is None else engines, workers)
        self.receiver = make_receiver(
            name, transfer_options(self.cfg), plan, self.engine, address, port, rank, size, handle
        )
        return True

    def sleep(self, level: int) -> float:
        """Colocated sleep mode: free the engine's GPU memory while the trainer steps."""
        return self.engine.sleep(level)

    def wake_up(self) -> float:
        return self.engine.wake_up()

    def pull_weights(self, version: int) -> dict:
        if self.receiver is None:  # a restarted process: the driver re-forms the group with it first
            raise NotInWeightGroup(
                f"rollout actor {self.index} is not in the weight-sync group (restarted, not yet rejoined)"
            )
        out = self.receiver.receive(version)
        self.has_weights = True
        return out

    def prefill(self, prompts: list[list[int]], params: SamplingParams, images=None, at_least: int = 0):
        """A prefill actor's call (from a decode actor's `PrefillRouter`): the engine's handle of
        the prompts' KV cache (`rlcore.engine.base.Prefilled`), returned through the object store.
        `at_least`: the asking decode engine's version; an engine still older answers
        `PrefillBehind` at once (its part of the sync lands in a moment; nothing is computed)."""
        if not self.has_weights:
            raise PrefillNotServing(
                f"rollout actor {self.index} (prefill) was restarted and has not received the weights yet"
            )
        if self.engine.policy_version < at_least:
            raise PrefillBehind(
                f"rollout actor {self.index} (prefill) holds version {self.engine.policy_version}, "
                f"the decode engine {at_least}"
            )
        with self.clock.busy():
            handle = self.engine.prefill(prompts, params, images)
        if not self.prefills:  # its log says it serves (stdout: OUTPUT_DIR/logs/rollout-INDEX.log)
            print(
                f"rollout actor {self.index} (prefill): first prefill served, at version {handle.version}", flush=True
            )
        self.prefills += 1
        return handle

    def release_version(self, version: int) -> bool:
        """A decode actor: every engine of both pools that the sync to `version` reached holds it
        (`PrefillRouter.release`: handles of it may decode now)."""
        if self.role == "decode":
            self.router.release(version)
        return True

    def pd_stats(self) -> dict[str, int]:
        """A decode actor: its router's counts by the version rule (`PrefillRouter.stats`); {} else."""
        return dict(self.router.stats) if self.role == "decode" else {}

    def set_prefill_serving(self, serving: list[int]) -> bool:
        """A decode actor: the prefill engines (positions in its router's list) that serve now."""
        if self.role == "decode":
            self.router.set_serving(serving)
        return True

    def canary_logprobs(self, pairs: list[tuple[list[int], list[int]]]) -> list[list[float]]:
        """The engine's teacher-forced logprobs (temperature 1) for the canary pairs."""
        return self.engine.score_batch([(list(p), list(c)) for p, c in pairs])

    def canary_completions(
        self, prompts: list[list[int]], temperature: float, max_new_tokens: int, seed: int
    ) -> list[list[int]]:
        """The engine's own completions of the canary's prompts (temperature 0: greedy)."""
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)
        return [g.token_ids for g in self.engine.generate([list(p) for p in prompts], params)]

    def sampling_params(self, seed: int | None = None, sampling: dict | None = None) -> SamplingParams:
        """The configured SamplingParams, with `sampling`'s fields and `seed` (seeds this request's
        sampling alone: reproducible whatever runs concurrently) when given."""
        if seed is None and not sampling:
            return self.params
        return dataclasses.replace(self.params, **(sampling or {}), **({"seed": seed} if seed is not None else {}))

    def generate_groups(
        self,
        tasks: list[Task],
        group_size: int,
        split: str = "train",
        seed: int | None = None,
        sampling: dict | None = None,
    ) -> list[Group]:
        """Run `group_size` episodes per task. Never raises for an engine or reward fault: the
        samples come back marked failed, so the driver can count them. `sampling` overrides fields
        of the configured SamplingParams (evaluation). Every request generates in the actor's
        generation slots (`rlcore.engine.slots`): one engine object for the environments, which
        may key state on it."""
        try:
            with self.clock.busy():
                groups = self.env.run_groups(
                    tasks, group_size, self.slots, self.tokenizer, self.sampling_params(seed, sampling)
                )
        except Exception as exc:
            groups = failed_groups(tasks, group_size, f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=3)}")
        stats = {"reward_threads_abandoned": threads_abandoned()}
        for g in groups:
            g.env_stats = stats
        return groups

    def generate_stream(self, tasks: list[Task], group_size: int, split: str = "train", seed: int | None = None):
        """`generate_groups` as a stream (call it with `.options(num_returns="streaming")`): two
        objects per group, in the order the groups are whole (`Environment.stream_groups`), so a
        reward that hangs delays its own group only: first its metadata, `(task index, list[SampleMeta],
        env_stats)`, which the driver reads, then its token data (`list[Sample]`), which only
        trainer ranks fetch (`actors.rollout_stream` reads it). Every task's group comes, once: a
        fault (engine, environment) fails the groups not yet sent. The caller owns every object
        of the stream, so the data outlives this actor (a restart loses none of it)."""
        sent: set[int] = set()
        why = None
        try:
            with self.clock.busy():
                for i, group in self.env.stream_groups(
                    tasks, group_size, self.slots, self.tokenizer, self.sampling_params(seed)
                ):
                    if i in sent or not 0 <= i < len(tasks) or len(group.samples) != group_size:
                        raise RuntimeError(
                            f"environment gave group {i} twice, out of range or of "
                            f"{len(group.samples)} samples ({len(tasks)} tasks x {group_size})"
                        )
                    sent.add(i)
                    yield i, samples_meta(group.samples), {"reward_threads_abandoned": threads_abandoned()}
                    yield group.samples
        except Exception as exc:
            why = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=3)}"
        left = [i for i in range(len(tasks)) if i not in sent]
        for i, group in zip(
            left,
            failed_groups([tasks[i] for i in left], group_size, why or "environment returned no group for this task"),
        ):
            yield i, samples_meta(group.samples), {"reward_threads_abandoned": threads_abandoned()}
            yield group.samples

    def generate_meta(
        self,
        tasks: list[Task],
        group_size: int,
        split: str = "eval",
        seed: int | None = None,
        sampling: dict | None = None,
    ) -> tuple[list[list[SampleMeta]], dict]:
        """`generate_groups` for a caller that needs the metadata only (evaluation rounds):
        `(per group list[SampleMeta], env_stats)`; the token data is not sent anywhere."""
        return meta_reply(self.generate_groups(tasks, group_size, split, seed, sampling))

    def cache_stats(self) -> dict[str, float]:
        """The engine's prefix-cache counters (vLLM: `VLLMEngine.cache_stats`); {} for an engine
        without them (benchmarks read them: hit rate with and without KV offload)."""
        stats = getattr(self.engine, "cache_stats", None)
        return stats() if stats is not None else {}

    def busy_seconds(self) -> float:
        """Seconds this actor spent generating (overlapping requests counted once)."""
        return self.clock.seconds()

    def policy_version(self) -> int:
        return self.engine.policy_version

    def start_profile(self, label: str) -> dict:
        """Record the engine's work (`profile.steps`) until `stop_profile`; what the timeline
        needs to know of this process (`rlcore.report.profiling.source_info`)."""
        self.engine.start_profile(label, self.cfg.profile.with_stack, self.cfg.profile.cpu_ops)
        return source_info(f"engine {self.index}", "engine")

    def stop_profile(self) -> list[tuple[str, bytes]]:
        """The engine's trace files since `start_profile`, as (name, bytes)."""
        return self.engine.stop_profile()

    def rng_state(self):
        """The engine's sampling RNG state (None if the engine has none)."""
        return self.engine.rng_state()

    def set_rng_state(self, state) -> bool:
        """Restore a state from `rng_state` (resume); False if the engine has no such RNG."""
        return state is not None and self.engine.set_rng_state(state)

    def load_checkpoint_weights(self, path: str, version: int) -> bool:
        """Load a checkpoint's model weights straight into the engine (evaluation of a
        checkpoint without a trainer group). A disaggregated group's caller then releases
        `version` (`release_version`) once every engine holds it, as a sync does."""
        from rlcore.models.build import build_model
        from rlcore.storage.checkpoint import load_model_weights

        model = build_model(self.cfg.model, self.tokenizer)
        load_model_weights(model, path)
        self.engine.apply_weights(model.named_parameters(), version)
        self.has_weights = True
        return True

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.engine.state_dict()
