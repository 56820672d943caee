"""Device meshes for data, context and expert parallelism, and the model transformation that
applies LoRA, expert parallelism, FP8 linears (`rlcore.trainer.float8`), context-parallel
attention, per-sample recurrent state (hybrid models, `rlcore.models.hybrid`), activation checkpointing, the chunked logprob head, torch.compile of the decoder layers
and FSDP2, in that order.

Layout (world = ``dp * cp`` ranks, row-major, like torchtitan's ``dp_shard x cp``)::

    rank = d * cp + c            d = data-parallel index (which micro-batches), c = context index
    world mesh (world,)          the one mesh (``Meshes.fsdp``); the two below are views of it.
                                 Dense parameters are sharded over *all* ranks: context ranks
                                 hold the same parameters, so sharding over them saves memory too
    cp mesh    (dp, cp)          the ``cp`` rows exchange sequence shards (Ulysses all-to-all)
    ep mesh    (world/ep, ep)    expert parallelism borrows ranks from dp*cp: each row of ``ep``
                                 consecutive ranks splits the experts; ``efsdp`` (the columns)
                                 shards each rank's local experts with FSDP2

Gradient scale contract: every rank backpropagates ``world * loss_r`` (``loss_r`` its share of
the global objective, ``sum_r loss_r``). FSDP2 averages dense gradients over the world, which
yields ``sum_r d loss_r``. Expert gradients already sum over the ``ep`` row (tokens were sent
to the expert's owner), so their reduce-scatter over ``efsdp`` divides by the world size too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from rlcore.batch.parallel_dims import ParallelDims
from rlcore.config import TrainerConfig
from rlcore.models.hybrid import restart_state_at_boundaries
from rlcore.models.moe_family import NO_VARLEN
from rlcore.models.vision import decoder_layers, is_vision_model, vision_tower
from rlcore.trainer.activation_checkpoint import apply_activation_checkpointing
from rlcore.trainer.attention import use_varlen_attention
from rlcore.trainer.compile import compile_layers
from rlcore.trainer.float8 import apply_float8
from rlcore.trainer.logprobs import install_logprob_head
from rlcore.trainer.lora import apply_lora
from rlcore.trainer.moe import apply_expert_parallel, model_family

TOKEN_MULTIPLE_ATTR = "rlcore_token_multiple"
"""Model attribute holding the multiple its packed token count is padded to (16 with FP8 linears;
`rlcore.trainer.forward.token_multiple` reads it)."""


@dataclass
class Meshes:
    """The process groups of one rank (see the module docstring for the layout)."""

    dims: ParallelDims
    fsdp: DeviceMesh
    cp_group: dist.ProcessGroup | None
    ep_group: dist.ProcessGroup | None
    efsdp: DeviceMesh | None

    @classmethod
    def build(cls, dims: ParallelDims, device_type: str) -> "Meshes":
        """One world mesh (every rank; FSDP2 shards dense parameters over it), and the cp and ep
        layouts as views of it (``_unflatten``, as torchtitan derives its sub-meshes), so every
        group comes from the same rank order; a TP dimension would be one more view."""
        world = init_device_mesh(device_type, (dims.world,), mesh_dim_names=("world",))
        cp_group = ep_group = efsdp = None
        if dims.cp > 1:
            cp_group = world._unflatten(0, (dims.dp, dims.cp), ("dp", "cp"))["cp"].get_group()
        if dims.ep > 1:
            ep_mesh = world._unflatten(0, (dims.world // dims.ep, dims.ep), ("efsdp", "ep"))
            ep_group, efsdp = ep_mesh["ep"].get_group(), ep_mesh["efsdp"]
        return cls(dims, world, cp_group, ep_group, efsdp)


def parallelize(
    model: torch.nn.Module,
    t: TrainerConfig,
    meshes: Meshes,
    device: torch.device,
    train: bool = True,
    attention: str | None = None,
    layer_units: bool | None = None,
) -> torch.nn.Module:
    """Transform a transformers causal LM in place for training on this rank; returns it.

    ``t`` is the TrainerConfig (``lora``, ``fp8``, ``activation_checkpointing``,
    ``logprob_chunk_tokens``, ``compile``, ``param_dtype``, ``mixed_precision``). ``train=False``
    (a frozen reference) skips LoRA, FP8 and checkpointing.
    ``attention``: ``"varlen"`` forces rlcore's variable-length attention (always used when
    cp > 1), ``"hf"`` keeps the model's own (transformers sdpa with a block-diagonal T x T mask),
    None picks varlen on CUDA with bf16 compute (flash kernels; the mask costs O(T^2) per packed
    micro-batch, 3x slower step at 16k tokens was seen) and the model's own elsewhere.
    ``layer_units``: each decoder layer its own FSDP2 unit (None: only when the mesh has more
    than one rank, see below).
    Parameter names stay the transformers names (weight sync and checkpoints rely on them).
    """

    lora = getattr(t, "lora", None)
    if train and lora is not None and lora.enabled:
        apply_lora(model, lora)
    moe_blocks = apply_expert_parallel(model, meshes.ep_group)
    fp8 = getattr(t, "fp8", "none") if train else "none"  # a frozen reference stays in bf16
    if fp8 != "none":
        if apply_float8(model, fp8, emulate=device.type != "cuda"):  # before fully_shard (torchao's contract)
            setattr(model, TOKEN_MULTIPLE_ATTR, 16)  # FP8 GEMMs: the packed token count too (forward pads)
    bf16_compute = mixed_precision_policy(t, device) is not None or param_dtype(t) == torch.bfloat16
    # a family whose attention the varlen kernel does not compute (gpt-oss: sinks, sliding windows)
    # keeps its own; `rlcore.plan` refuses cp > 1 for it
    own_attention = model_family(model) in NO_VARLEN
    if own_attention and (meshes.dims.cp > 1 or attention == "varlen"):
        raise ValueError(
            f"{model_family(model)}: rlcore's varlen attention does not compute this family's attention "
            "sinks and sliding windows (no context parallelism, no attention='varlen')"
        )
    auto_varlen = attention is None and device.type == "cuda" and bf16_compute and not own_attention
    # packed VLM rows carry 3-D mrope positions, from which transformers cannot infer sample
    # boundaries: the language model always runs rlcore's varlen attention with explicit ones
    if meshes.dims.cp > 1 or attention == "varlen" or auto_varlen or is_vision_model(model):
        use_varlen_attention(model, meshes.cp_group)
    restart_state_at_boundaries(model)  # hybrid models: each packed sample starts a fresh state
    mode = getattr(t, "activation_checkpointing", "none") if train else "none"
    apply_activation_checkpointing(model, mode)
    head = install_logprob_head(model, getattr(t, "logprob_chunk_tokens", 0))
    head.keep_logits_bytes = int(getattr(t, "logprob_keep_logits_gib", 0.0) * 2**30)
    if getattr(t, "compile", False):
        compile_layers(model)  # per layer, after checkpointing, before FSDP2 (see trainer.compile)
        head.compiled = True

    dtype = param_dtype(t)
    if dtype != torch.float32:
        # stored weights, gradients and AdamW state in this dtype; buffers (RoPE inv_freq) keep theirs
        with torch.no_grad():
            for p in model.parameters():
                p.data = p.data.to(dtype)
    mp = mixed_precision_policy(t, device)
    kwargs = {"mp_policy": mp} if mp else {}
    # with one rank per mesh, resharding after forward frees nothing: keep the unsharded
    # (compute-dtype) parameters for backward instead of gathering and casting them again
    if meshes.efsdp is not None:
        for block in moe_blocks:
            # experts are their own FSDP unit on the efsdp mesh; see the gradient-scale contract
            fully_shard(block.experts, mesh=meshes.efsdp, reshard_after_forward=meshes.efsdp.size() > 1, **kwargs)
            block.experts.set_gradient_divide_factor(float(meshes.dims.world))
    reshard = meshes.dims.world > 1
    tower = vision_tower(model)
    if tower is not None:  # its own unit: gathered once for all images (and frozen as a whole)
        fully_shard(tower, mesh=meshes.fsdp, reshard_after_forward=reshard, **kwargs)
    if layer_units if layer_units is not None else meshes.dims.world > 1:
        for layer in decoder_layers(model):
            fully_shard(layer, mesh=meshes.fsdp, reshard_after_forward=reshard, **kwargs)
    # with one rank, per-layer units would shard, free and overlap nothing but still run their
    # hooks around every layer's forward and backward (host time the GPU waits for at small
    # models): the root unit alone gathers (casts) all parameters once per step
    fully_shard(model, mesh=meshes.fsdp, reshard_after_forward=reshard, **kwargs)
    return model


def begin_micro_batch(model: torch.nn.Module, meshes: Meshes, last: bool) -> None:
    """Set FSDP2's per-micro-batch switches before a forward/backward of gradient accumulation.

    Gradients are reduced only after the ``last`` micro-batch's backward. With one rank
    (nothing is sharded), the unsharded compute-dtype parameters are also kept from
    one micro-batch's backward to the next forward instead of being freed and gathered (copied
    and cast) again; the last backward frees them, so the forward after the optimizer step
    gathers the updated weights."""
    model.set_requires_gradient_sync(last)
    if meshes.dims.world == 1:  # (an expert mesh exists only with ep > 1, hence world > 1)
        model.set_reshard_after_backward(last)


PARAM_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def param_dtype(t) -> torch.dtype:
    """``trainer.param_dtype`` as a torch dtype (float32 when the config has no such field)."""
    return PARAM_DTYPES[getattr(t, "param_dtype", "float32") or "float32"]


def mixed_precision_policy(t, device: torch.device) -> MixedPrecisionPolicy | None:
    """FSDP2 policy: bf16 compute with fp32 gradient reduction on GPU when
    ``trainer.mixed_precision`` (float32 stored weights are cast once per layer per step);
    None on CPU or when disabled."""
    if device.type != "cuda" or not t.mixed_precision:
        return None
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def clip_grad_norm(model: torch.nn.Module, max_norm: float, meshes: Meshes) -> float:
    """Global L2 gradient norm over all parameters (clipped to ``max_norm`` when > 0).

    ``||g||^2 = sum over ranks of sum_p ||local shard of g_p||^2``: FSDP2 shards every dense
    parameter over the fsdp mesh (all ranks) and every expert parameter over its ``efsdp`` column,
    and the ``ep`` rows hold different experts, so each gradient element lives on exactly one
    rank; one all-reduce of one scalar over the world gives the total. (A replicated DTensor
    dimension or a plain, unsharded gradient is counted once by dividing by its replication.)
    Local norms use ``torch._foreach_norm`` and the clip one ``_foreach_mul_`` by
    ``min(1, max_norm / (norm + 1e-6))`` (no host sync before it); the host sees the norm once,
    as the return value.
    """
    world = dist.get_world_size() if dist.is_initialized() else 1
    groups: dict[int, list[torch.Tensor]] = {}
    for p in model.parameters():
        g = p.grad
        if g is None:
            continue
        if isinstance(g, DTensor):
            rep = 1
            for i, placement in enumerate(g.placements):
                if placement.is_replicate():
                    rep *= g.device_mesh.size(i)
            groups.setdefault(rep, []).append(g.to_local())
        else:
            groups.setdefault(world, []).append(g)
    device = _device_of(model)
    total = torch.zeros((), dtype=torch.float32, device=device)
    with torch.no_grad():
        for rep, grads in groups.items():
            norms = torch._foreach_norm(grads, 2.0, dtype=torch.float32)
            total = total + torch.stack(norms).square().sum() / rep
        if world > 1:
            dist.all_reduce(total, group=meshes.fsdp.get_group())
        norm = total.sqrt()
        if max_norm > 0:
            coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
            for grads in groups.values():
                torch._foreach_mul_(grads, coef)
    return float(norm)


def _device_of(model: torch.nn.Module) -> torch.device:
    p = next(model.parameters())
    return p.to_local().device if isinstance(p, DTensor) else p.device
