"""The SFT driver (`mode=sft`) and the RL warm-up: the trainer group alone (`TrainerGroup`),
stepping through the data that `rlcore.sft.dataset` reads, tokenizes and orders (see there for the data
rules). Start, checkpoint save / load and export are the trainer group's, shared with RL."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Callable

from actors.groups import place
from actors.resume import resume_from
from actors.trainer_group import TrainerGroup
from rlcore.models.tokenizer_build import build_tokenizer
from rlcore.plan.layout import Plan
from rlcore.report.startup import StartupPhases
from rlcore.sft.dataset import SFTData, build_dataset, step_shards
from rlcore.storage import checkpoint as ckpt
from rlcore.storage.checkpoint import CheckpointWriter

log = logging.getLogger("rlcore")


def warmup(cfg, trainers: TrainerGroup, between: Callable[[], None] = lambda: None) -> int:
    """Supervised warm-up before RL (`sft.warmup_steps` steps on `sft.dataset`, same trainer
    group and optimizer); returns the trainer's policy version afterwards. `between()` runs
    before each step (the RL driver checks there on the engines starting meanwhile: one that
    died stops the warm-up with its error)."""

    data = build_dataset(cfg, build_tokenizer(cfg.model))
    version = 0
    for step in range(cfg.sft.warmup_steps):
        between()
        shards, loss_tokens, _ = step_shards(cfg, data, step)
        result = trainers.sft_step(shards, loss_tokens, f"SFT warm-up step {step + 1}")
        version = int(result["version"])
        if step == 0 or (step + 1) % 10 == 0 or step + 1 == cfg.sft.warmup_steps:
            log.info("SFT warm-up step %d/%d: loss %.4f", step + 1, cfg.sft.warmup_steps, result["loss"])
    return version


# -- the run -----------------------------------------------------------------------------------
class SFTDriver:
    """`mode=sft`: the trainer group alone (no rollout group), same checkpoints and metrics.
    `plan`: what `rlcore.plan.layout.run_plan` decided (its config is the run's)."""

    def __init__(self, plan: Plan, data: SFTData | None = None):
        self.plan = plan
        cfg = self.cfg = plan.config
        self.data = data
        self.groups = None
        self.trainers: TrainerGroup | None = None
        self.start_step = 0
        self.startup = StartupPhases()
        self.writer = CheckpointWriter(cfg)

    def setup(self) -> None:
        cfg = self.cfg
        if self.data is None:
            self.data = build_dataset(cfg, build_tokenizer(cfg.model))
        with self.startup.phase("placing actors"):
            self.groups = place(self.plan, rollout=False)
        self.trainers = self.groups.trainers
        with self.startup.phase("starting the trainer and loading its model"):
            self.trainers.start()
        self.writer.clean_stale()
        path = ckpt.resolve_resume(cfg)
        if path is None:
            return
        state, _ = resume_from(path, "sft", cfg, self.trainers, ("metrics.jsonl",))
        if state.get("num_examples") != len(self.data.samples):
            log.warning(
                "resume: the dataset has %d examples, the checkpoint's had %s: the data order differs",
                len(self.data.samples),
                state.get("num_examples"),
            )
        self.start_step = int(state["step"])
        log.info("resumed SFT from %s at step %d", path, self.start_step)

    def step_shards(self, step: int):
        return step_shards(self.cfg, self.data, step)

    def run(self, logger) -> list[dict[str, Any]]:
        cfg = self.cfg
        history = []
        run_start = time.perf_counter()
        for step in range(self.start_step, cfg.steps):
            start = time.perf_counter()
            shards, loss_tokens, epoch = self.step_shards(step)
            m = dict(self.trainers.sft_step(shards, loss_tokens, f"SFT step {step + 1}"))
            m.pop("version", None)
            dt = max(time.perf_counter() - start, 1e-9)
            record = {
                "step": step + 1,
                "epoch": epoch,
                "step_time_s": dt,
                "tokens_per_s": m.pop("train_tokens") / dt,
                "elapsed_s": time.perf_counter() - run_start,
                **m,
            }
            logger.log(record)
            history.append(record)
            final = step + 1 == cfg.steps
            if self.writer.due(step + 1, final):
                self.save(step + 1)
            if final and cfg.checkpoint.export_final:
                self.trainers.export()
        return history

    def save(self, step: int) -> Path:
        def state() -> dict[str, Any]:
            return {
                "kind": "sft",
                "step": step,
                "examples_seen": step * self.cfg.sft.batch_examples,
                "num_examples": len(self.data.samples),
                "rng": ckpt.rng_state(),
            }

        return self.trainers.save(self.writer, step, state)

    def shutdown(self) -> None:
        if self.groups is not None:
            self.groups.shutdown()
            self.groups = None
