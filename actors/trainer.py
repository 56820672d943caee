"""Trainer rank actor: a thin Ray wrapper around `rlcore.trainer.core.TrainerCore`.

The driver imports this module only to hand the class to Ray; the trainer's own stack (the
model, FSDP, torch.compile: sympy and dynamo, seconds of imports) loads in the rank's process,
inside the methods that use it, so the driver's start-up does not pay for it."""

from __future__ import annotations

import os
import time
from dataclasses import replace
from typing import TYPE_CHECKING

import ray
import torch

from actors.logs import redirect_output
from actors.remote import died
from rlcore.batch.packing import MicroBatch
from rlcore.batch.step import RankWork, rank_micro_batches, rank_sample_versions, sample_places
from rlcore.config import RunConfig
from rlcore.engine.registry import tensor_parallel_size, weight_transport
from rlcore.report.profiling import TraceRecorder, source_info
from rlcore.storage.checkpoint import load_trainer, save_trainer
from rlcore.transfer import make_sender, sender_for, transfer_options, world_size
from rlcore.transfer.base import Sender
from rlcore.transfer.plan import SyncPlan

if TYPE_CHECKING:
    from rlcore.trainer.core import TrainerCore


def unreadable(exc: BaseException) -> str | None:
    """Why an object's value cannot be read, when `exc` (raised by `ray.get`) says it never will
    be; None for anything else (a timeout, this process's own fault): those are raised."""
    if isinstance(exc, ray.exceptions.ObjectLostError):
        return "lost with the node that made it"
    # a rollout actor killed just after it streamed a group can leave its own error where the
    # group's token data was, though the driver took the ref while the actor lived and owns it
    # (Ray 2.60, objects past max_direct_call_object_size: ActorUnavailableError in 2 of 15 runs of
    # test_multinode's engine kill). Raised, it read as this rank's death, and each restart of
    # the trainer group trained the same refs again until trainer.max_restarts ran out.
    # (an actor's death as `died` reads it for a call, and a restart still under way, which for
    # an object's value is final)
    if died(exc) or isinstance(exc, ray.exceptions.ActorUnavailableError):
        return f"lost with the actor that made it ({type(exc).__name__})"
    return None


def fetch_token_data(refs: list, timeout_s: float) -> tuple[list | None, list[int], str]:
    """(the objects of `refs`, [], ""), or (None, the indices of those that cannot be read, why):
    Ray keeps an object a rollout actor made in that actor's node's store, and a node that died
    took the only copy with it; an actor that died as it sent one can leave its error in the
    object's place (`unreadable`). The generate call is not re-run: its samples' metadata is
    already the driver's. Any other error (`trainer.step_timeout_s` passed) is raised."""
    try:
        return ray.get(refs, timeout=timeout_s), [], ""
    except ray.exceptions.RayError as exc:
        if unreadable(exc) is None:
            raise
    lost, why = [], ""
    for i, ref in enumerate(refs):
        try:
            ray.get(ref, timeout=timeout_s)
        except ray.exceptions.RayError as exc:
            if (reason := unreadable(exc)) is None:
                raise
            lost.append(i)
            why = why or reason
    return (None, lost, why) if lost else (ray.get(refs, timeout=timeout_s), [], "")


class TrainerRank:
    """One FSDP2 rank. Every method that runs collectives must be called on all ranks at once."""

    def __init__(self, cfg: RunConfig, rank: int, world_size: int):
        redirect_output(cfg.output_dir, "trainer", rank)
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.device = "cuda" if cfg.trainer.gpus_per_rank > 0 else "cpu"
        torch.set_num_threads(max(1, int(cfg.trainer.cpus_per_rank)))
        self.core: TrainerCore | None = None
        self.sender: Sender | None = None
        # aliases of the parameters a colocated one-rank sync reads (None: not built, or this
        # rank does not hold every parameter whole); a checkpoint load rebuilds them
        self._whole: list[tuple[str, torch.Tensor]] | None = None
        self._recorder: TraceRecorder | None = None  # `profile.steps`
        self._trained: RankWork | None = None  # the last RL step's work, less its data handles

    def address(self) -> tuple[str, int]:
        """Where this rank can host a rendezvous (called on rank 0)."""
        from rlcore.trainer.core import free_port

        return ray.util.get_node_ip_address(), free_port()

    def init_distributed(self, master_addr: str, master_port: int) -> bool:
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = master_addr, str(master_port)
        if self.device == "cuda":
            torch.cuda.set_device(0)  # Ray exposes exactly this rank's GPU as device 0
        from rlcore.trainer.core import TrainerCore

        self.core = TrainerCore(self.cfg, self.rank, self.world_size, device=self.device)
        return True

    def parameter_metas(self) -> list[tuple[str, tuple[int, ...], str]]:
        return self.core.parameter_metas()

    def init_weight_group(self, address: str, port: int, plan: SyncPlan, engines: int | None = None) -> dict | None:
        """Rank 0 joins the weight-sync group of `engines` rollout actors (default: all) as its
        sender (the engines join at the same time).
        Colocated: every rank makes its CUDA IPC buffer and returns its handle (for the engine on
        its GPU); None otherwise."""
        name = weight_transport(self.cfg)
        every_rank = sender_for(name).every_rank
        if every_rank and self.sender is not None:  # each rank feeds the engine on its GPU
            return self.sender.handle()  # a restarted engine reopens the same buffer (same plan)
        if self.rank == 0 or every_rank:
            size = world_size(
                name,
                self.cfg.rollout.num_actors if engines is None else engines,
                tensor_parallel_size(self.cfg.rollout),
            )
            self.sender = make_sender(name, transfer_options(self.cfg), plan, self.device, address, port, size)
        return self.sender.handle() if self.sender is not None else None

    def canary_logprobs(self, pairs: list[tuple[list[int], list[int]]]) -> list[list[float]]:
        """Teacher-forced logprobs (temperature 1) of each completion after its prompt, under the
        current weights (collective: every rank runs the same forward; rank 0's answer is used)."""
        return self.core.score_pairs(pairs)

    def train_step(self, work: RankWork, normalizer: float, release_memory: bool = False) -> dict:
        """One optimizer step (collective) on this rank's part of the batch: fetch the token data
        of its samples from the object store (the refs in `work.data`, nested so that Ray hands
        them over unresolved; bounded by `trainer.step_timeout_s`; where a group's data was lost
        with the node or actor that made it (`fetch_token_data`), no rank trains and each returns
        `token_data_lost`, the indices into `work.data` it could not read, and
        `token_data_lost_why`), pack them by the driver's plan
        (`rlcore.batch.step.rank_micro_batches`), and train. `train_fetch_s`: the fetch and
        packing seconds (outside `train_time_s`). Colocated, the new weights are also written into this
        rank's IPC buffer before returning (`weights_pushed`, as `push_weights` returns it): the
        driver's sync is then one call, the engines' receive. `release_memory`: hand the caching
        allocator's free blocks back after the step (an engine asleep on this GPU wakes into them;
        the placement's decision, `WeightSync`'s). What the step's forward computed stays on the
        rank until its next step (`last_step_logprobs`)."""
        start = time.perf_counter()
        try:
            data, lost, why, error = *fetch_token_data(work.data, self.cfg.trainer.step_timeout_s), None
        except Exception as exc:  # noqa: BLE001 - raised below, once the other ranks know
            data, lost, why, error = None, [], "", exc
        if not self.core.every_rank(data is not None):  # no rank trains a batch another cannot read
            if error is not None:
                raise error
            return {"token_data_lost": lost, "token_data_lost_why": why}
        micro_batches = rank_micro_batches(work, data)
        fetch_s = time.perf_counter() - start
        result = self.core.train_step(micro_batches, normalizer, rank_sample_versions(work, data))
        self._trained = replace(work, data=[])  # not the refs: they would hold the token data in the store
        pushed = {}
        if self.sender is not None and self.sender.buffered:
            pushed = {"weights_pushed": self.push_weights()}
        memory = {}
        if self.device == "cuda":
            free, total = torch.cuda.mem_get_info()
            memory = {
                "trainer_peak_gib": torch.cuda.max_memory_reserved() / 2**30,
                "gpu_used_gib": (total - free) / 2**30,
            }  # every process on this GPU
            if release_memory:
                torch.cuda.empty_cache()  # the caching allocator's free blocks back to the driver
        return {
            **result.metrics,
            **memory,
            **pushed,
            "version": result.version,
            "lr": result.lr,
            "train_fetch_s": fetch_s,
        }

    def last_step_logprobs(self, keys: list[tuple[int, int]], version: int) -> dict[tuple[int, int], list[float]]:
        """The trainer logprobs of the samples of `keys` ((group position in the batch, sample
        index): `rlcore.report.samples.shown_keys`) that this rank trained in the RL step that
        made `version`: per key, what that step's forward computed along the sample's packed
        positions (prompt then completion; position t scores token t + 1), under the weights
        before its update. No collective: each rank answers for the samples it held
        (context-parallel ranks alike: each holds the whole sequence's logprobs); {} when its
        last step is another."""
        if self._trained is None or self.core is None:
            return {}
        return self.core.last_step_logprobs(version, sample_places(self._trained, keys))

    def sft_step(self, micro_batches: list[MicroBatch], global_loss_tokens: int) -> dict:
        self._trained = None  # its micro-batches are no RL step's work
        result = self.core.sft_step(micro_batches, global_loss_tokens)
        return {**result.metrics, "version": result.version, "lr": result.lr}

    def save_checkpoint(self, path: str) -> dict[str, int]:
        """Write this rank's shard into checkpoint directory `path` (collective); rank 0 returns
        every file the trainer side of the checkpoint needs ({relative path: bytes}), others {}."""
        return save_trainer(self.core, path)

    def load_checkpoint(self, path: str) -> int:
        """Load a checkpoint saved at any trainer world size (collective); returns its version."""
        self._whole = None  # the load may have replaced the parameters' storage
        return load_trainer(self.core, path)

    def load_engine_weights(self, named: dict, version: int) -> int:
        """Take an engine's weights (`RolloutWorker.state_dict`, by trainer name) as policy
        `version`; the optimizer starts afresh (collective, `TrainerCore.load_full_weights`)."""
        self._whole = None  # the load may have replaced the parameters' storage
        self.core.load_full_weights(named, version)
        return self.core.version

    def export_hf(self, out_dir: str) -> str | None:
        """Write the current full weights as a Hugging Face directory from rank 0 (collective:
        every rank takes part in gathering the parameters)."""
        params = self.core.full_parameters()
        if self.rank != 0:
            for _ in params:
                pass
            return None
        import itertools

        from rlcore.storage.export import hub_named, write_hf_dir
        from rlcore.trainer.export import persistent_buffers

        tensors = itertools.chain(params, persistent_buffers(self.core.model))  # e.g. a router's correction bias
        return str(
            write_hf_dir(
                out_dir,
                hub_named(self.core.model, tensors),
                model=self.core.model,
                tokenizer=self.core.tokenizer,
                dtype=self.cfg.model.dtype,
            )
        )

    def push_weights(self) -> dict:
        """Gather full parameters (all ranks) and broadcast them from rank 0, bucket by bucket
        (colocated: every rank writes its IPC buffer; one rank that holds the whole model reads
        its parameters' storage directly, `TrainerCore.whole_parameters`)."""
        start = time.perf_counter()
        if self.sender is not None and self.sender.buffered and self.world_size == 1:
            if self._whole is None:
                self._whole = self.core.whole_parameters()
            if self._whole is not None:
                sent = self.sender.send(iter(self._whole))
                return {"sync_bytes": sent, "sync_send_s": time.perf_counter() - start}
        params = self.core.full_parameters()
        sent = 0
        try:
            if self.sender is not None:  # rank 0, or every rank when colocated
                sent = self.sender.send(params)
        finally:
            # finish the FSDP all-gathers even if a broadcast failed: the other ranks are in them
            for _ in params:
                pass
        return {"sync_bytes": sent, "sync_send_s": time.perf_counter() - start}

    def start_profile(self, label: str) -> dict:
        """Record this rank (`profile.steps`: its CPU ops and GPU kernels) until `stop_profile`;
        what the timeline needs to know of this process (`rlcore.report.profiling.source_info`)."""
        if self._recorder is None:
            self._recorder = TraceRecorder(self.cfg.profile.with_stack, self.cfg.profile.cpu_ops)
        self._recorder.start(label)
        return source_info(f"trainer rank {self.rank}", "trainer")

    def stop_profile(self) -> list[tuple[str, bytes]]:
        """This rank's trace since `start_profile`, as [(name, gzipped Chrome trace bytes)]."""
        if self._recorder is None:
            return []
        if self.device == "cuda":
            torch.cuda.synchronize()  # the step's last kernels end inside the recording
        return self._recorder.stop()

    def full_state(self) -> dict[str, torch.Tensor]:
        """Full parameters on CPU (collective; for tests and checks)."""
        return {n: t.cpu().clone() for n, t in self.core.full_parameters()}

    def shutdown(self) -> None:
        if self.core:
            self.core.shutdown()
