"""The schema of what happens around the training loop: logging, checkpoints, supervised
fine-tuning (and the RL warm-up), evaluation. Part of `rlcore.config.RunConfig`; one docstring
per field, YAML only sets values."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from rlcore.config.bounds import bounded


@dataclass
class LoggerConfig:
    """Where metrics go."""

    wandb: bool = False
    """Log to Weights & Biases (offline mode when no API key is set)."""
    project: str = "rlcore"
    """wandb project."""
    run_name: Optional[str] = None
    """wandb run name (null = wandb's own)."""
    console: bool = True
    """Progress bar and one line per step on the console."""
    samples_every: int = bounded(10, ge=0)
    """Every this many RL steps, log sample completions (prompt, completion, reward, policy version)
    to `samples.jsonl` in output_dir and, with wandb, as a wandb.Table `samples` (0 = never)."""
    samples_per_table: int = bounded(8, gt=0)
    """Completions per samples table (spread over the step's groups)."""
    watch_port: int = bounded(0, ge=0, le=65535, note="(0 = no page)")
    """Serve the live run page (`python -m rlcore.watch OUTPUT_DIR`) on 127.0.0.1:PORT beside the
    run, in its own process, and print its address at start (0 = no page)."""


@dataclass
class CheckpointConfig:
    """Checkpoints (trainer via torch.distributed.checkpoint + driver state), resume and export."""

    dir: Optional[str] = None
    """Directory holding `step_NNNNNNNN/` checkpoints (null = `{output_dir}/checkpoints`)."""
    interval: int = bounded(0, ge=0)
    """Save every this many steps (0 = only the final one, if `save_final`)."""
    keep_last: int = bounded(3, ge=0)
    """Committed checkpoints to keep; older ones are deleted after a save (0 = keep all)."""
    save_final: bool = True
    """Save after the last step (`rl` and `sft` modes)."""
    resume: Optional[str] = None
    """`true`/`latest`: continue from the newest checkpoint in `dir` (fresh start if none); a path:
    that checkpoint (must exist); null/`false`: fresh start. `resume=...` on the CLI is an alias."""
    export_final: bool = False
    """After the last step, also write the weights as a Hugging Face model directory."""
    export_dir: Optional[str] = None
    """Where `export_final` writes (null = `{output_dir}/hf`)."""
    timeout_s: float = bounded(600.0, gt=0)
    """Longest a checkpoint waits on one of its parts: the trainer ranks' shards, the engines' RNG
    states (an engine that gives none in time, or is frozen for `rollout.stall_timeout_s`, is saved
    without its state and the checkpoint goes on), the upload of the run's files to an object store."""


@dataclass
class StorageConfig:
    """An object-store `output_dir` (s3://, gs://, ...): the run's series are kept in a local staging
    folder on the driver's node and uploaded whole; checkpoints go straight to the store."""

    sync_interval_s: float = 300.0
    """Seconds between uploads of the staging folder (metrics, samples, logs) to the store, besides
    the uploads at every checkpoint and at the end of the run (0 = only those)."""
    url: str = ""
    """Set by the planner, never by hand: the object-store URL `output_dir` named; `output_dir` is
    then its local staging folder (empty for a local or NFS `output_dir`)."""


@dataclass
class SFTConfig:
    """Supervised fine-tuning on chat data (`mode=sft`); loss on assistant tokens only."""

    dataset: str = "env"
    """A `.jsonl` file of `{"messages": [...]}` rows, `env` (demonstrations: the task prompts of
    `env` answered with their reference answers), or a `datasets` hub name / saved dataset dir."""
    split: str = "train"
    """Split of the `datasets` dataset, or of the environment for `env`."""
    messages_key: str = "messages"
    """Field holding the chat messages in a JSONL row or dataset record."""
    num_examples: int = bounded(0, ge=0)
    """Use the first N examples (0 = all; `env` needs N > 0: the number of tasks rendered)."""
    batch_examples: int = bounded(32, ge=1)
    """Examples per optimizer step."""
    max_seq_len: int = bounded(2048, ge=2)
    """Longer tokenized examples are dropped (and counted)."""
    warmup_steps: int = bounded(0, ge=0)
    """In `rl` mode: SFT steps on `dataset` before the first RL step (fresh runs only), on the same
    trainer group and optimizer; the RL run's policy versions continue from them."""
    lr: Optional[float] = bounded(None, gt=0, note="(null = trainer.lr)")
    """Learning rate of every SFT step (the warm-up's and `mode=sft`'s), constant; null =
    `trainer.lr` and its schedule. Lets a warm-up learn fast and the RL steps after it go slow."""
    shuffle: bool = True
    """Reshuffle the examples every epoch (seeded by `seed` and the epoch: order is reproducible)."""


@dataclass
class EvalConfig:
    """Evaluation on the environment's eval split: mean reward and unbiased pass@k."""

    every_n_steps: int = bounded(0, ge=0)
    """During `rl`, evaluate the current policy after every N steps and after the last (0 = never)."""
    at_start: bool = False
    """During a fresh `rl` run with `every_n_steps` > 0, also evaluate the starting policy (after
    any SFT warm-up), logged as step 0: the "before" of a before/after comparison."""
    num_tasks: int = bounded(0, ge=0, note="(0 = the whole eval split)")
    """Tasks of the eval split per evaluation: indices 0..num_tasks-1 (0 = the whole split)."""
    samples_per_task: int = bounded(8, ge=1)
    """Completions per task (n of pass@k)."""
    k: list[int] = field(default_factory=lambda: [1, 8])
    """pass@k values reported (each <= samples_per_task)."""
    correct_threshold: float = 1.0
    """A completion counts as correct for pass@k when its reward is >= this."""
    split: str = "eval"
    """Environment split evaluated."""
    temperature: Optional[float] = bounded(None, ge=0)
    """Sampling temperature (null = rollout.sampling.temperature)."""
    max_new_tokens: Optional[int] = bounded(None, ge=1)
    """Completion length cap (null = rollout.sampling.max_new_tokens)."""
    seed: int = 1234
    """Sampling seed of evaluation requests: every evaluation draws with the same randomness."""
    timeout_s: float = bounded(600.0, gt=0)
    """Longest the end of a run waits for evaluations still running (and, in a synchronous run,
    a weight sync for the evaluation of the policy it replaces)."""


@dataclass
class ProfileConfig:
    """A timeline of chosen RL steps: every trainer rank and every engine records its CPU ops and
    GPU kernels over the same wall-clock window (`python -m rlcore.timeline OUTPUT_DIR`)."""

    steps: list[int] = field(default_factory=list)
    """RL steps (1-based) to record, each from the moment its batch goes to the trainer until its
    weights reach the engines; traces land in `{output_dir}/profile` (empty = record nothing)."""
    cpu_ops: bool = True
    """The trainer ranks (and in-process engines) record their CPU ops too, not only GPU kernels and
    copies: what each thread ran, at a cost to a launch-bound step (false: kernels and copies only)."""
    with_stack: bool = False
    """Record Python stacks of the trainer's and the engines' ops (larger traces, slower steps)."""
    timeout_s: float = bounded(300.0, gt=0)
    """Longest a process may take to start or to stop and hand back its trace."""
