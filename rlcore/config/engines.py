"""Engine sections of the config schema: each engine's own options (`rollout.vllm.*`,
`rollout.hf.*`, and the same sections under `teacher.*`).

An engine reads only its own section; :mod:`rlcore.engine.registry` names each engine's section
(attribute and class), and validation refuses (command line) or warns about (YAML) options set
in the section of an engine that is not the selected one. A plug-in engine's section is declared
by its registration instead (:mod:`rlcore.config.plugins`); these classes are never changed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from rlcore.config.bounds import bounded, choice, from_registry
from rlcore.config.plugins import PluginSections


@dataclass
class VLLMOptions:
    """Options of the vLLM engine (`rollout.engine=vllm` / `teacher.engine=vllm`)."""

    tensor_parallel_size: int = bounded(1, gt=0)
    """Tensor parallelism inside one vLLM engine (GPUs per engine)."""
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra vLLM `AsyncEngineArgs`, e.g. enforce_eager, gpu_memory_utilization, max_model_len."""
    weight_reload: str = choice("auto", "direct", "layerwise", default="auto", noun="weight reload")
    """Receive path: `direct` (buckets copied straight into the parameters between two engine
    steps, no pause), `layerwise` (vLLM's reload; needed when weights are processed after
    loading, e.g. quantised) or `auto` (direct, layerwise with `quantization`). Rollout only."""
    kv_on_update: str = choice("keep", "recompute", default="keep", noun="KV policy")
    """KV cache of requests in flight at a weight update: `keep` (continue on the new weights with
    the KV computed so far; new requests never reuse older versions' prefix cache) or
    `recompute` (preempt and recompute their prefix under the new weights). Rollout only."""
    quantization: Optional[str] = choice(None, "fp8", default=None, noun="quantization")
    """Online weight quantization: null (bf16) or `fp8` (weights re-quantized on every sync,
    dynamic per-token activation scales; Hopper/Ada only). Rollout only."""
    sleep_level: int = choice(0, 1, 2, default=0, noun="sleep level")
    """Colocated engines only: 0 keeps the engine resident beside the trainer (asynchronous
    schedules overlap decoding with training); 1 (weights offloaded to CPU) or 2 (weights dropped,
    refilled by the next sync) puts the engine to sleep while the trainer steps, freeing its GPU
    memory for models that do not fit beside the trainer (synchronous schedule only). Rollout only."""
    sampling_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra vLLM `SamplingParams` of every request, e.g. `ignore_eos: true` (every completion
    `rollout.sampling.max_new_tokens` long: fixed-work benchmarks) or `min_p`, `top_k`,
    `repetition_penalty`. What `rollout.sampling` sets is refused here."""
    routing_replay: bool = False
    """Rollout routing replay (MoE policies only): the engine returns each token's routed experts
    (vLLM's `enable_return_routed_experts`) and the trainer's MoE blocks use them instead of their
    own top-k (`rlcore.batch.routing`). Rollout only."""
    kv_offload_gb: float = bounded(0.0, ge=0, note="(0 = no offload)")
    """Host memory (GiB) per engine that vLLM's native CPU offload keeps evicted KV blocks in
    (`kv_offloading_size`, backend `native`), so a later turn's prefix is copied back instead of
    recomputed; 0 = off. The plan counts it against the node's RAM (`cluster.memory_per_node_gib`).
    Rollout only."""
    warm_engine_core: bool = True
    """Fork vLLM's engine-core process from a server the actor starts first, which imports vLLM
    while the actor does (`rlcore.engine.vllm.warm_core`), instead of vLLM's spawn of a fresh
    interpreter that imports it again after the actor: ~14 s less engine start-up on an H100."""


@dataclass
class HFOptions:
    """Options of the transformers engine (`rollout.engine=hf` / `teacher.engine=hf`).

    It runs the run's model (`model.*`) on a GPU when `rollout.gpus_per_actor` > 0, else on the
    CPU. The section also keeps a setting meant for another engine from passing for one of this
    engine's."""

    routing_replay: bool = False
    """Rollout routing replay (MoE policies only): the engine returns each token's routed experts
    (hooks on the model's routers) and the trainer's MoE blocks use them instead of their own
    top-k (`rlcore.batch.routing`). Rollout only."""


@dataclass
class EngineGroupConfig(PluginSections):
    """What every group of engine actors sets (`rollout.*`, `teacher.*`): the engine, its
    actors and their bundles, calls in flight, restarts, and each built-in engine's section (a
    plug-in engine's section, `<group>.<section>.*`, is declared by its registration:
    :mod:`rlcore.config.plugins`)."""

    engine: str = from_registry("rlcore/engine/registry.py", default="hf")
    """`hf` (transformers engine, CPU or GPU) or `vllm` (GPU only): a name in `rlcore/engine/registry.py`;
    the engine reads its own section (`<group>.vllm.*`, `<group>.hf.*`)."""
    num_actors: int = bounded(1, gt=0)
    """Number of actors (engine replicas, one actor each, on the group's placement group)."""
    cpus_per_actor: float = bounded(1.0, gt=0)
    """CPUs reserved in each of the group's bundles."""
    gpus_per_actor: float = bounded(0.0, ge=0)
    """GPUs reserved in each of the group's bundles (0 = CPU; with the vllm engine >= vllm.tensor_parallel_size)."""
    max_restarts: int = 3
    """Times Ray restarts a dead actor (its calls in flight are counted failed; a rollout actor
    then rejoins the weight group); -1 = always."""
    env_vars: dict[str, str] = field(default_factory=dict)
    """Environment variables of the group's actor processes and the engine processes they start
    (e.g. `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`, `VLLM_*`). `RLCORE_*` names are rlcore's own."""
    vllm: VLLMOptions = field(default_factory=VLLMOptions, metadata={"engine_section": True})
    """Options of the vllm engine (`<group>.vllm.*`; a teacher never receives weights, so the
    rollout-only options must keep their defaults there)."""
    hf: HFOptions = field(default_factory=HFOptions, metadata={"engine_section": True})
    """Options of the hf engine (`<group>.hf.*`)."""
