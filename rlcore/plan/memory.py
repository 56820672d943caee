"""GPU memory of a colocated trainer rank and vLLM engine, planned from the config alone.

Estimates (bytes), for a model of P parameters (from `model.arch`), S = dp x cp shards:
- trainer state: P x (master + gradient) bytes of `trainer.param_dtype`, sharded over S, Adam's two
  moments in the same dtype, sharded; plus the unsharded bf16 compute copy under mixed precision;
- activations at `trainer.micro_batch_tokens` tokens: per token and layer 2 x (5h + 3q + 2kv + 4i)
  bytes in bf16 (layer inputs, norms, q/k/v/attention output, the MLP's gate, up, product and
  down input; flash attention keeps no score matrix), one layer's worth plus 2h per layer under
  activation checkpointing; plus the logprob head's logits (chunk x vocab, fp32, capped by
  `trainer.logprob_keep_logits_gib`);
- the bf16 gradients of the compute copy under mixed precision (P x 2, before the reduction);
- the IPC sync buffer: P x 2 bytes (the bf16 weights the engine reads);
- OVERHEAD_GIB per process (CUDA context), and the sum times FRAGMENTATION (the caching
  allocator reserves more than it hands out).
Calibrated on nvidia-h200 (docs/benchmarks.md, issue 18): the Qwen3-4B shape at 4096 tokens
peaked at 104.3 GiB reserved; this plan gives 104.1 GiB. The 0.6B shape used ~14 GiB; the plan
gives 18.2 (the estimate errs high for small models: the fixed overhead dominates).
The engine needs at least its bf16 weights plus ENGINE_MIN_FREE_GIB (activations, some KV cache),
plus, for a hybrid model (Qwen3-Next, Qwen3.5, Nemotron-H), the fixed recurrent state of every
sequence it holds at once (`rlcore.plan.hybrid_memory`; their parameters are counted there too).
A GPU teacher beside them (on-policy distillation) holds its `gpu_memory_utilization` of the GPU,
which must itself hold the teacher's bf16 weights plus ENGINE_MIN_FREE_GIB.
The engine's cache budget (`colocated_cache_bytes`): its share of the GPU less its bf16 weights and
ENGINE_WORKSPACE_GIB; given to an engine that takes one (vLLM's `kv_cache_memory_bytes`), it
makes the engine's size independent of what the trainer holds at that moment, so both start at once.
Pure functions of the config; `model.path` checkpoints are planned from the facts a recipe
restates in `model.arch` and skipped when those are missing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from rlcore.batch.staleness import most_groups_in_flight
from rlcore.config import RunConfig
from rlcore.engine.registry import (
    engine_options,
    engine_spec,
    has_option,
    memory_share,
    memory_share_key,
    option_key,
    sleep_level,
)
from rlcore.models.moe_family import num_routed_experts
from rlcore.plan.hybrid_memory import hybrid_param_count, layer_pattern, recurrent_state_bytes
from rlcore.plan.teacher import gpu_share, teacher_run_config

GIB = 2**30
OVERHEAD_GIB = 2.0
FRAGMENTATION = 1.1
ENGINE_MIN_FREE_GIB = 2.0
ENGINE_WORKSPACE_GIB = 4.0
"""What a colocated engine holds besides its weights and its cache: the CUDA context, the largest
forward's activations and logits, the sampler's buffers, the CUDA-graph pool."""
MAX_ENGINE_FRACTION = 0.6
"""Cap of the engine's automatic share: more KV cache than this rarely speeds a colocated run,
and the rest is headroom for the trainer's allocator."""
TRAINER_MARGIN = 1.2
"""The automatic share leaves the trainer this multiple of its estimate (the estimate is rough;
the fit check itself uses the estimate as is)."""
CHAR_VOCAB_BOUND = 256
"""The built-in character tokenizer's vocabulary is under this (the embedding is negligible)."""
BPE_VOCAB_SIZE = 384
"""The built-in BPE's vocabulary (`rlcore.models.tokenizer.BPE_VOCAB_SIZE`, not imported here)."""

_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def _arch(cfg: RunConfig) -> dict | None:
    a = dict(cfg.model.arch)
    a = {**a, **a.get("text_config", {})} if isinstance(a.get("text_config"), dict) else a
    if "num_hidden_layers" not in a and layer_pattern(a):  # Nemotron-H: the block pattern's length
        a["num_hidden_layers"] = len(layer_pattern(a))
    if not all(k in a for k in ("hidden_size", "num_hidden_layers", "num_attention_heads")):
        return None
    return a


def _vocab(cfg: RunConfig, a: dict) -> int:
    if a.get("vocab_size"):
        return int(a["vocab_size"])
    return {"char": CHAR_VOCAB_BOUND, "bpe": BPE_VOCAB_SIZE}.get(cfg.model.tokenizer, 152_064)


def param_count(cfg: RunConfig, active: bool = False) -> int | None:
    """Parameters of the (dense or MoE) decoder described by `model.arch`; None when unknown.
    `active`: those one token runs through (a MoE layer's top-k routed experts, not all)."""
    a = _arch(cfg)
    if a is None:
        return None
    hybrid = hybrid_param_count(a, _vocab(cfg, a), active)
    if hybrid is not None:
        return hybrid
    h, layers, heads = int(a["hidden_size"]), int(a["num_hidden_layers"]), int(a["num_attention_heads"])
    hd = int(a.get("head_dim") or h // heads)
    kvh = int(a.get("num_key_value_heads") or heads)
    q, kv = heads * hd, kvh * hd
    per_layer = h * q + 2 * h * kv + q * h + 2 * h + 2 * hd
    vocab = _vocab(cfg, a)
    embed = vocab * h * (1 if a.get("tie_word_embeddings", False) else 2)
    return layers * per_layer + _mlp_params(a, h, layers, active) + embed + h


def _mlp_params(a: dict, h: int, layers: int, active: bool = False) -> int:
    """The MLP parameters of all layers: dense, or routed experts (+ router, + shared experts) with a
    family's dense first layers (`first_k_dense_replace`, `mlp_only_layers`) kept dense. `active`:
    a MoE layer counts only the top-k routed experts a token runs through."""
    dense = 3 * h * int(a.get("intermediate_size") or 4 * h)
    experts = num_routed_experts(a)
    if not experts:
        return layers * dense
    inter = int(a.get("moe_intermediate_size") or a.get("intermediate_size") or 4 * h)
    shared = 3 * h * (int(a.get("n_shared_experts") or 0) * inter + int(a.get("shared_expert_intermediate_size") or 0))
    used = min(experts, int(a.get("num_experts_per_tok") or experts)) if active else experts
    moe = used * 3 * h * inter + experts * h + shared
    n_dense = min(int(a.get("first_k_dense_replace") or 0) + len(a.get("mlp_only_layers") or ()), layers)
    return n_dense * dense + (layers - n_dense) * moe


@dataclass
class TrainerMemory:
    """Bytes one colocated trainer rank holds on its GPU (see the module docstring)."""

    state: int  # master weights, gradients, optimizer moments, compute copy
    activations: int
    sync_buffer: int
    overhead: int

    @property
    def peak(self) -> int:
        return int((self.state + self.activations + self.sync_buffer + self.overhead) * FRAGMENTATION)

    @property
    def resident(self) -> int:
        """What stays while the trainer is idle (activations released to the driver)."""
        return int((self.state + self.sync_buffer + self.overhead) * FRAGMENTATION)


def trainer_memory(cfg: RunConfig) -> TrainerMemory | None:
    """The trainer rank's footprint; None when `model.arch` does not give the model's shape."""
    p, a = param_count(cfg), _arch(cfg)
    if p is None or a is None:
        return None
    t = cfg.trainer
    shards = max(t.world_size, 1)
    width = _BYTES.get(t.param_dtype, 4)
    trainable = p if not t.lora.enabled else 0  # LoRA adapters are tiny next to the base
    state = (p * width + trainable * 3 * width) / shards
    if t.mixed_precision and width > 2:
        state += p * 2 * 2  # the gathered bf16 compute copy and its bf16 gradients
    h, layers, heads = int(a["hidden_size"]), int(a["num_hidden_layers"]), int(a["num_attention_heads"])
    hd = int(a.get("head_dim") or h // heads)
    q, kv = heads * hd, int(a.get("num_key_value_heads") or heads) * hd
    inter = int(a.get("moe_intermediate_size") or a.get("intermediate_size") or 4 * h)
    if num_routed_experts(a):
        inter *= int(a.get("num_experts_per_tok") or 1)
    per_token_layer = 2 * (5 * h + 3 * q + 2 * kv + 4 * inter)
    tokens = t.micro_batch_tokens // max(t.cp, 1)
    if t.activation_checkpointing == "none":
        acts = tokens * layers * per_token_layer
    else:
        acts = tokens * (layers * 2 * h + per_token_layer)
    chunk = t.logprob_chunk_tokens or tokens
    logits = min(min(chunk, tokens) * _vocab(cfg, a) * 4 * 2, int(t.logprob_keep_logits_gib * GIB) or 1 << 62)
    return TrainerMemory(
        state=int(state), activations=int(acts + logits), sync_buffer=p * 2, overhead=int(OVERHEAD_GIB * GIB)
    )


def engine_min_bytes(cfg: RunConfig) -> int | None:
    """Least an engine can run in: bf16 weights plus ENGINE_MIN_FREE_GIB, plus, for a hybrid
    model, the recurrent state of the most sequences it holds at once (`max_sequences_per_engine`)."""
    p, a = param_count(cfg), _arch(cfg)
    if p is None or a is None:
        return None
    return p * 2 + int(ENGINE_MIN_FREE_GIB * GIB) + recurrent_state_bytes(a) * max_sequences_per_engine(cfg)


def teacher_bytes(cfg: RunConfig, gpu_bytes: int) -> int:
    """What a GPU teacher sharing each colocated GPU holds: its vLLM `gpu_memory_utilization` x
    the GPU (0 without one; an unset share is refused in `rlcore.plan.teacher`)."""
    t = cfg.teacher
    if not gpu_share(cfg):
        return 0
    return int(float(memory_share(t) or 0) * gpu_bytes)


def _trainer_bytes_beside_engine(cfg: RunConfig, mem: TrainerMemory) -> int:
    """A sleeping engine (sleep_level > 0) gives its memory back while the trainer steps, so the
    awake engine only sits beside the trainer's resident part; a resident engine beside its peak."""
    return mem.resident if sleep_level(cfg.rollout) else mem.peak


def colocated_engine_fraction(cfg: RunConfig, gpu_bytes: int) -> float | None:
    """The `gpu_memory_utilization` left for a colocated engine: (GPU - trainer) / GPU, rounded
    down to 0.01 and capped at MAX_ENGINE_FRACTION, with the trainer taken at TRAINER_MARGIN x its
    estimate; None when the model's shape is unknown."""
    mem = trainer_memory(cfg)
    if mem is None:
        return None
    free = gpu_bytes - TRAINER_MARGIN * _trainer_bytes_beside_engine(cfg, mem) - teacher_bytes(cfg, gpu_bytes)
    return max(0.0, min(MAX_ENGINE_FRACTION, math.floor(free / gpu_bytes * 100) / 100))


def colocated_cache_bytes(cfg: RunConfig, gpu_bytes: int) -> int | None:
    """Cache bytes for a colocated engine of `cfg` (share resolved) on a GPU of `gpu_bytes`: its
    share x the GPU, less its bf16 weights and ENGINE_WORKSPACE_GIB, floored to a MiB. None where
    the engine must size itself from the memory free at its start instead, i.e. where the engine
    and the trainer cannot start side by side: no share, an unknown model shape, a sleep level
    (the plan leaves the trainer's peak room only while the engine sleeps), a GPU teacher (it
    sizes itself from what the two left), or less than ENGINE_MIN_FREE_GIB of cache."""
    share, weights = memory_share(cfg.rollout), param_count(cfg)
    if share is None or weights is None or sleep_level(cfg.rollout) or gpu_share(cfg):
        return None
    cache = float(share) * gpu_bytes - weights * 2 - ENGINE_WORKSPACE_GIB * GIB
    if cache < ENGINE_MIN_FREE_GIB * GIB:
        return None
    return int(cache) // 2**20 * 2**20


def max_sequences_per_engine(cfg: RunConfig) -> int:
    """The most sequences one engine holds at once in RL: the groups the staleness bound lets be in
    flight (`rlcore.batch.staleness.most_groups_in_flight`) plus one request's overshoot
    (tasks_per_request), shared by the actors, times group_size. Evaluation requests may add to
    it for a while (their batches above the largest captured size run without a CUDA graph)."""
    a, r = cfg.algo, cfg.rollout
    groups = most_groups_in_flight(a.max_off_policy_steps, a.batch_groups) + r.tasks_per_request
    return math.ceil(groups / max(r.num_actors, 1)) * a.group_size


def planned_engine_kwargs(cfg: RunConfig, gpu_bytes: int | None) -> dict:
    """The rollout engine's `engine_kwargs` derived from the run (placement resolved): its cache
    budget when colocated (`colocated_cache_bytes`), and what the engine's own hook derives from
    the sequences it can hold (`EngineSpec.planned_kwargs`). Keys the user set are left out."""
    spec, r = engine_spec(cfg.rollout.engine), cfg.rollout
    out: dict = {}
    if spec.planned_kwargs is not None:
        out.update(spec.planned_kwargs(engine_options(r), max_sequences_per_engine(cfg)))
    if cfg.current_placement() == "colocated" and spec.memory_budget_kwarg and gpu_bytes:
        budget = colocated_cache_bytes(cfg, gpu_bytes)
        if budget is not None:
            out[spec.memory_budget_kwarg] = budget
    given = getattr(engine_options(r), "engine_kwargs", {})
    return {k: v for k, v in out.items() if k not in given}


def _gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


def memory_problems(cfg: RunConfig, gpu_bytes: int) -> list[tuple[str, str]]:
    """One line when the colocated trainer rank, engine (and GPU teacher) do not fit one GPU of
    `gpu_bytes`, or the teacher's share cannot hold its weights."""
    mem, need = trainer_memory(cfg), engine_min_bytes(cfg)
    if mem is None or need is None:
        return []
    teacher = teacher_bytes(cfg, gpu_bytes)
    teacher_need = engine_min_bytes(teacher_run_config(cfg)) if teacher else None
    if teacher_need is not None and teacher < teacher_need:
        return [
            (
                memory_share_key(cfg.teacher, "teacher"),
                f"the teacher's share of the {_gib(gpu_bytes)} "
                f"GPU, {_gib(teacher)}, cannot hold its bf16 weights + {ENGINE_MIN_FREE_GIB:g} GiB "
                f"({_gib(teacher_need)}): raise it",
            )
        ]
    beside = _trainer_bytes_beside_engine(cfg, mem)
    share_key = engine_spec(cfg.rollout.engine).memory_share_kwarg
    fraction, asleep = memory_share(cfg.rollout), sleep_level(cfg.rollout)
    engine = max(need, int(float(fraction) * gpu_bytes)) if fraction is not None else need
    total = beside + engine + teacher
    if total <= gpu_bytes:
        return []
    if fraction is not None and beside + need + teacher <= gpu_bytes:
        key = memory_share_key(cfg.rollout)  # the engine's share alone is too large
    elif not asleep and total - mem.activations <= gpu_bytes:
        key = "trainer.micro_batch_tokens"  # fewer activation bytes would make it fit
    else:
        key = "placement"
    what = (
        f"trainer {_gib(beside)} (state {_gib(mem.state)}, activations at trainer.micro_batch_tokens="
        f"{cfg.trainer.micro_batch_tokens} {_gib(mem.activations if not asleep else 0)}, "
        f"sync buffer {_gib(mem.sync_buffer)}, overhead {_gib(mem.overhead)}) + engine {_gib(engine)}"
        + (f" ({share_key}={fraction})" if fraction is not None else f" (bf16 weights + {ENGINE_MIN_FREE_GIB:g} GiB)")
    )
    if teacher:
        what += f" + teacher {_gib(teacher)} ({memory_share_key(cfg.teacher, 'teacher')})"
    hint = (
        f"set {option_key(cfg.rollout, 'sleep_level')}=2 with algo.max_off_policy_steps=0, "
        if has_option(cfg.rollout, "sleep_level") and not asleep
        else ""
    )
    return [
        (
            key,
            f"colocated on one {_gib(gpu_bytes)} GPU: {what} = {_gib(total)} do not fit; "
            f"{hint}lower trainer.micro_batch_tokens or the engine's share, or use placement=split",
        )
    ]
