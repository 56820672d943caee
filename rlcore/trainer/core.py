"""One trainer rank: an FSDP2-sharded policy, AdamW, and the RL train step.

Pure torch.distributed: the Ray actor in `actors/trainer.py` only sets up the rendezvous and
calls these methods on every rank in lock-step (but `last_step_logprobs`, which reads what this
rank's last step kept, `rlcore.trainer.last_step`, and runs no collective).
"""

from __future__ import annotations

import datetime
import math
import time
import warnings
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist

from rlcore.algo.distill import top_k_loss
from rlcore.algo.losses import LossInputs, policy_loss
from rlcore.batch.packing import MicroBatch, make_micro_batch
from rlcore.batch.parallel_dims import ParallelDims
from rlcore.config import RunConfig
from rlcore.models.build import build_model, build_tokenizer
from rlcore.models.vision import vision_tower
from rlcore.trainer import export
from rlcore.trainer.forward import forward_columns, forward_logprobs
from rlcore.trainer.last_step import LastStep
from rlcore.trainer.moe import router_metrics
from rlcore.trainer.parallel import Meshes, begin_micro_batch, clip_grad_norm, parallelize
from rlcore.trainer.schedule import build_scheduler
from rlcore.types import Sample

TOP_K_SUMS = ("teacher_top_k_kl_sum", "teacher_top_k_mass_sum", "student_top_k_mass_sum")
"""The token sums `rlcore.algo.distill.top_k_loss` reports."""
PLAIN_MEANS = ("mismatch_kl", "kl_ref", "teacher_top_k_kl", "teacher_top_k_mass", "student_top_k_mass")
"""Token means reported under their own name (the other `X_sum` metrics become `X_mean`)."""


def step_metrics(
    totals: dict[str, float], extrema: dict[str, float], grad_norm: float, seconds: float
) -> dict[str, float]:
    """Per-step metrics from rank-summed token sums: `*_sum` and `*_frac` become means over
    loss tokens (`mismatch_kl_sum` -> `mismatch_kl`, `ratio_sum` -> `ratio_mean`), except the two
    parts of the mismatch, each a mean over its own tokens: `engine_mismatch_kl` over the tokens
    sampled by the weights trained (`same_version_frac` of them), `staleness_kl` over the others;
    a part without tokens this step is left out (not 0: nothing was measured)."""
    n = max(totals["loss_tokens"], 1.0)
    totals = dict(totals)
    split = {k: totals.pop(k) for k in ("engine_mismatch_kl_sum", "staleness_kl_sum") if k in totals}
    out = {
        "loss": totals["loss"],
        "entropy": totals["entropy"] / n,
        "grad_norm": grad_norm,
        "train_tokens": totals["tokens"],
        "loss_tokens": totals["loss_tokens"],
        "train_time_s": seconds,
    }
    for k, v in totals.items():
        if k.endswith("_frac"):
            out[k] = v / n
        elif k.endswith("_sum"):
            base = k.removesuffix("_sum")
            out[base if base in PLAIN_MEANS else base + "_mean"] = v / n
    if split:
        same = totals.get("same_version_frac", 0.0)
        for key, count in (("engine_mismatch_kl", same), ("staleness_kl", totals["loss_tokens"] - same)):
            if count > 0:
                out[key] = split[key + "_sum"] / count
    out.update({k: v for k, v in extrema.items() if math.isfinite(v)})
    return out


def sft_loss(inp: LossInputs, normalizer: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``-sum_t m_t log p(x_t) / normalizer``: cross-entropy on the masked (assistant) tokens."""
    return -(inp.logprobs * inp.loss_mask).sum() / normalizer, {}


@dataclass
class StepResult:
    metrics: dict[str, float]
    version: int
    lr: float
    """The learning rate this step used (`sft.lr` in an SFT step when set, else the scheduler's)."""


class TrainerCore:
    """Holds the sharded model and optimizer of one rank."""

    def __init__(self, cfg: RunConfig, rank: int, world_size: int, device: str = "cpu"):
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.device = torch.device(device)
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        timeout = datetime.timedelta(seconds=cfg.trainer.step_timeout_s)
        if not dist.is_initialized():
            dist.init_process_group(backend=backend, rank=rank, world_size=world_size, timeout=timeout)
        # dp x cp x ep meshes (rlcore.trainer.parallel); self.mesh is the FSDP2 mesh of dense params
        self.parallel = Meshes.build(ParallelDims.from_config(cfg.trainer, world_size), self.device.type)
        self.mesh = self.parallel.fsdp
        torch.manual_seed(cfg.seed)
        self.tokenizer = build_tokenizer(cfg.model)
        model = build_model(cfg.model, self.tokenizer).to(self.device)
        self.vision = getattr(self.tokenizer, "rlcore_vision", None)
        if cfg.model.freeze_vision:
            vision_tower(model).requires_grad_(False)  # before sharding: the optimizer never sees it
        self.model = self._shard(model)
        t = cfg.trainer
        trainable = [p for p in self.model.parameters() if p.requires_grad]  # LoRA: adapters only
        # fused: one kernel for all parameters on GPU (the foreach default elsewhere)
        self.optimizer = torch.optim.AdamW(
            trainable,
            lr=t.lr,
            betas=tuple(t.betas),
            weight_decay=t.weight_decay,
            fused=self.device.type == "cuda" or None,
        )
        self.scheduler = build_scheduler(self.optimizer, t, cfg.steps)
        self.version = 0
        self._sample_versions: list[torch.Tensor] | None = None  # set for one train_step
        self.last_step: LastStep | None = None  # the logprobs of the last step (`last_step_logprobs`)
        # RL scores tokens under the tempered distribution the engines sample from; SFT fits the
        # model's own (temperature 1) distribution to the data
        self.temperature = 1.0 if cfg.mode == "sft" else max(cfg.rollout.sampling.temperature, 1e-6)
        self.reference = None
        if cfg.algo.kl_coef > 0:
            # frozen copy of the initial policy, sharded like it, for the KL-to-reference term
            reference = build_model(cfg.model, self.tokenizer).to(self.device).eval()
            reference.requires_grad_(False)
            self.reference = self._shard(reference, train=False)

    def _shard(self, model: torch.nn.Module, train: bool = True) -> torch.nn.Module:
        """LoRA, expert/context parallelism, activation checkpointing, the chunked logprob head,
        then FSDP2 (each decoder layer its own unit, then the root): `parallel.parallelize`."""
        return parallelize(model, self.cfg.trainer, self.parallel, self.device, train=train)

    def forward_logprobs(
        self, mb: MicroBatch, model: torch.nn.Module | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Logprobs and entropies [T] of a packed micro-batch (chunked head; cp-gathered)."""
        return forward_logprobs(
            model or self.model, mb, self.temperature, self.parallel, self.device, vision=self.vision
        )

    @torch.no_grad()
    def score_pairs(self, pairs: list[tuple[list[int], list[int]]]) -> list[list[float]]:
        """Teacher-forced logprobs (temperature 1) of each completion after its prompt through the
        trainer's own forward (packed, chunked head), under the current weights. Collective: every
        rank runs the same forward."""
        samples = [Sample(list(p), list(c), [0.0] * len(c), [0] * len(c), [1] * len(c)) for p, c in pairs]
        mb = make_micro_batch(samples, [0.0] * len(samples))
        logprobs, _ = forward_logprobs(self.model, mb, 1.0, self.parallel, self.device)
        logprobs, mask = logprobs.float().cpu(), mb.loss_mask.bool()
        return [logprobs[(mb.sample_index == i) & mask].tolist() for i in range(len(pairs))]

    def train_step(
        self,
        micro_batches: list[MicroBatch],
        normalizer: float,
        sample_versions: list[torch.Tensor] | None = None,
    ) -> StepResult:
        """One RL optimizer step (the configured policy loss) over this rank's micro-batches;
        `normalizer` comes from `rlcore.algo.losses.loss_normalizer` over the global batch.
        `sample_versions[i]`: the oldest behaviour version of each sample of micro-batch i
        (`rlcore.batch.step.rank_sample_versions`); with it the mismatch is split into
        `engine_mismatch_kl` and `staleness_kl`. The step's logprobs are kept until the next
        step (:meth:`last_step_logprobs`)."""
        self._sample_versions = sample_versions
        try:
            return self._step(micro_batches, normalizer, self._rl_loss)
        finally:
            self._sample_versions = None

    def last_step_logprobs(self, version: int, places: dict) -> dict:
        """The logprobs the last step's forward computed (the weights before its update) along
        the packed positions of each sample `places` names (`key -> (micro-batch, sample_index)`,
        `rlcore.batch.step.sample_places`), when that step made `version`; {} otherwise (no
        step yet, or a later one). No collective: read between steps."""
        kept = self.last_step
        if kept is None or kept.version != version or not places:
            return {}
        return kept.segments(places)

    def _rl_loss(self, inp: LossInputs, normalizer: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The configured policy loss, plus `teacher.top_k_coef` x the top-k distillation term
        (`rlcore.algo.distill.top_k_loss`, same normaliser) when the batch carries a teacher's top-k."""
        loss, metrics = policy_loss(inp, self.cfg.algo, normalizer)
        t = self.cfg.teacher
        if inp.teacher_top_k_logprobs is not None:
            top_k, top_metrics = top_k_loss(
                inp.top_k_logprobs, inp.teacher_top_k_logprobs, inp.loss_mask, t.kl_deadband
            )
            loss = loss + t.top_k_coef * top_k / max(normalizer, 1.0)
            metrics.update(top_metrics)
        elif t.enabled and t.top_k > 0:
            # a micro-batch without samples (a rank's filler): the same metric keys on every rank,
            # or the step's all-reduce of the sums would not line up
            metrics.update({k: torch.zeros((), device=self.device) for k in TOP_K_SUMS})
        return loss, metrics

    def sft_step(self, micro_batches: list[MicroBatch], global_loss_tokens: int, lr: float | None = None) -> StepResult:
        """One supervised step: token-level negative log-likelihood of the masked tokens, at `lr`
        when given, else at `sft.lr` when set (the scheduler sets the next step's rate again
        after it)."""
        lr = lr if lr is not None else self.cfg.sft.lr
        if lr is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
        return self._step(micro_batches, float(max(global_loss_tokens, 1)), sft_loss)

    def _loss_inputs(
        self,
        mb: MicroBatch,
        logprobs: torch.Tensor,
        entropy: torch.Tensor,
        index: int = 0,
        top_k: torch.Tensor | None = None,
    ) -> LossInputs:
        same = None
        if self._sample_versions is not None:
            # self.version is still the version before this step: the weights that score the batch
            same = (self._sample_versions[index] == self.version)[mb.sample_index].to(self.device, non_blocking=True)
        ref = None
        if self.reference is not None:
            with torch.no_grad():
                ref, _ = self.forward_logprobs(mb, self.reference)
        return LossInputs(
            logprobs=logprobs,
            behaviour_logprobs=mb.behaviour_logprobs.to(self.device, non_blocking=True),
            advantages=mb.advantages.to(self.device, non_blocking=True),
            loss_mask=mb.loss_mask.to(self.device, non_blocking=True),
            sample_index=mb.sample_index.to(self.device, non_blocking=True),
            ref_logprobs=ref,
            entropy=entropy if self.cfg.algo.entropy_coef > 0 else None,
            same_version=same,
            top_k_logprobs=top_k,
            teacher_top_k_logprobs=(
                mb.teacher_top_k_logprobs.to(self.device, non_blocking=True) if top_k is not None else None
            ),
        )

    def _step(self, micro_batches: list[MicroBatch], normalizer: float, loss_fn) -> StepResult:
        """One optimizer step over this rank's micro-batches.

        Each micro-batch's loss is a sum divided by `normalizer`, a global-batch count (loss
        tokens for token-level losses); FSDP averages gradients over ranks, so the loss is scaled
        by the world size to make the update the gradient of the global objective.
        """
        start = time.perf_counter()
        lr = float(self.optimizer.param_groups[0]["lr"])  # before the scheduler sets the next step's
        self.model.train()
        self.last_step = None  # the previous step's logprobs go before this step's are made
        # metric sums stay on the device until the step ends: no host sync between micro-batches
        sums: dict[str, torch.Tensor | float] = {"loss_tokens": 0.0, "tokens": 0.0}
        kept: list[torch.Tensor] = []  # each micro-batch's logprobs (`last_step`)
        maxima: dict[str, torch.Tensor] = {}
        minima: dict[str, torch.Tensor] = {}

        def acc(d: dict, k: str, v, op) -> None:
            v = torch.as_tensor(v, device=self.device).detach().to(torch.float64).reshape(())
            d[k] = op(d[k], v) if k in d else v

        for i, mb in enumerate(micro_batches):
            begin_micro_batch(self.model, self.parallel, last=i == len(micro_batches) - 1)
            # the teacher's top-k (distillation) only in RL steps: SFT's loss has no use for it
            others = mb.teacher_top_k_ids if loss_fn == self._rl_loss else None
            logprobs, entropy, top_k = forward_columns(
                self.model, mb, self.temperature, self.parallel, self.device, vision=self.vision, others=others
            )
            inp = self._loss_inputs(mb, logprobs, entropy, i, top_k)
            kept.append(logprobs.detach().clone())  # a compact [T] copy: the forward's columns are wider
            loss, metrics = loss_fn(inp, normalizer)
            (loss * self.world_size).backward()
            acc(sums, "loss", loss, torch.add)
            acc(sums, "entropy", (entropy.detach() * inp.loss_mask).sum(), torch.add)
            sums["loss_tokens"] += float(mb.loss_mask.sum())  # the host copy: no sync
            sums["tokens"] += mb.num_tokens
            for k, v in metrics.items():
                if k.endswith("_max"):
                    acc(maxima, k, v, torch.maximum)
                elif k.endswith("_min"):
                    acc(minima, k, v, torch.minimum)
                elif k != "entropy_sum":  # entropy is always reported above
                    acc(sums, k, v, torch.add)
        grad_norm = self._clip_grads()
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.version += 1
        # the cp ranks of a data-parallel group all count the same micro-batches
        totals = {k: v / self.parallel.dims.cp for k, v in self._all_reduce(sums, dist.ReduceOp.SUM).items()}
        extrema = {**self._all_reduce(maxima, dist.ReduceOp.MAX), **self._all_reduce(minima, dist.ReduceOp.MIN)}
        metrics = step_metrics(totals, extrema, grad_norm, time.perf_counter() - start)
        metrics.update(router_metrics(self.model))
        self.last_step = LastStep(self.version, kept, [mb.sample_index for mb in micro_batches])
        return StepResult(metrics=metrics, version=self.version, lr=lr)

    def _clip_grads(self) -> float:
        return clip_grad_norm(self.model, self.cfg.trainer.max_grad_norm, self.parallel)

    def every_rank(self, ok: bool) -> bool:
        """Whether `ok` holds on every rank (collective: one rank's False is every rank's answer).
        The ranks agree on it before a step's collectives, so that no rank enters them alone."""
        if self.world_size == 1:
            return ok
        return self._all_reduce({"ok": float(ok)}, dist.ReduceOp.MIN)["ok"] > 0

    def _all_reduce(self, values: dict[str, float], op) -> dict[str, float]:
        if not values:
            return {}
        keys = sorted(values)
        t = torch.stack([torch.as_tensor(values[k], dtype=torch.float64, device=self.device).reshape(()) for k in keys])
        dist.all_reduce(t, op=op)
        return dict(zip(keys, t.tolist()))

    def full_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Unsharded parameters in a fixed order, as the engine expects them (experts gathered
        over ep, LoRA merged). Collective: every rank must iterate fully."""
        yield from export.full_parameters(self.model)

    def whole_parameters(self) -> list[tuple[str, torch.Tensor]] | None:
        """`full_parameters` as aliases of this rank's storage when it holds every parameter
        whole (see `export.whole_parameters`); None otherwise."""
        return export.whole_parameters(self.model)

    def load_full_weights(self, named: dict[str, torch.Tensor], version: int) -> None:
        """Take full (unsharded) weights by `full_parameters` name as policy `version`, with a
        fresh optimizer state and the learning-rate schedule at step `version` (a trainer group
        restarted from the weights its engines hold). Collective. Raises ValueError where those
        names are not the model's own (LoRA merges adapters, expert parallelism gathers experts)
        or a parameter is missing or has another shape."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        experts, adapters, merged = export._plan(self.model)
        if adapters or merged or any(ex.ep_size > 1 for ex in experts.values()):
            raise ValueError(
                "the engines' weights are merged (LoRA) or gathered (expert parallelism): "
                "they cannot be loaded back into the trainer's parameters"
            )
        for name, shape, _ in self.parameter_metas():
            if name not in named or tuple(named[name].shape) != tuple(shape):
                got = tuple(named[name].shape) if name in named else "missing"
                raise ValueError(f"engine weights: parameter {name} is {got}, the trainer's is {tuple(shape)}")
        own = set(self.model.state_dict())
        set_model_state_dict(
            self.model,
            {k: v for k, v in named.items() if k in own},
            options=StateDictOptions(full_state_dict=True, strict=False),
        )
        self.version = int(version)
        with warnings.catch_warnings():  # "scheduler.step() before optimizer.step()": intended here
            warnings.simplefilter("ignore")
            for _ in range(self.version):  # the schedule's position is the optimizer-step count
                self.scheduler.step()

    def parameter_metas(self) -> list[tuple[str, tuple[int, ...], str]]:
        """(name, full shape, dtype) of every parameter, in `full_parameters` order."""
        return export.parameter_metas(self.model)

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]
