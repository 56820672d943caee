"""Config checks of the vLLM engine's section (`rollout.vllm.*`; its registry hook), torch-free:
they run before Ray starts."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rlcore.config import RunConfig

KEY = "rollout.vllm"
SAMPLING_OWNED = {
    **{
        k: f"set rollout.sampling.{f} instead"
        for k, f in (("max_tokens", "max_new_tokens"), ("temperature", "temperature"), ("top_p", "top_p"))
    },
    "seed": "each request's seed comes from `seed` and the task (set `seed`, or "
    "rollout.request_seeds=false for the engine's own RNG)",
    "stop_token_ids": "the engine stops at the tokenizer's end-of-sequence ids and the environment's",
    **{
        k: "the engine sets it: the trainer needs exactly one sampled token's logprob per position, as token ids"
        for k in ("n", "logprobs", "flat_logprobs", "output_kind", "detokenize", "prompt_logprobs")
    },
}
"""`SamplingParams` fields the engine sets from `rollout.sampling` or needs as they are: refused in
`rollout.vllm.sampling_kwargs`, with what to do instead."""


def vllm_problems(cfg: RunConfig) -> list[tuple[str, str]]:
    """The section's values; the engine arguments its fields own; whole GPUs per engine under
    split placement (colocated or `auto` engines take a share of one GPU, which
    `rlcore.plan.placement.placement_problems` checks once the placement is resolved); what the
    colocated IPC receive cannot serve once placement is colocated."""
    r, v = cfg.rollout, cfg.rollout.vllm
    out: list[tuple[str, str]] = []
    # each field's own bound or allowed values are on the field (rlcore.config.engines, VLLMOptions)
    if (
        v.tensor_parallel_size > 0
        and r.gpus_per_actor < v.tensor_parallel_size
        and (cfg.current_placement() == "split" or r.gpus_per_actor <= 0)
    ):
        out.append(
            (
                "rollout.gpus_per_actor",
                f"the vllm engine needs {KEY}.tensor_parallel_size "
                f"({v.tensor_parallel_size}) GPUs per actor, got {r.gpus_per_actor}",
            )
        )
    if v.weight_reload == "direct" and v.quantization is not None:
        out.append(
            (
                f"{KEY}.weight_reload",
                f"'direct' copies weights in unprocessed; quantization="
                f"{v.quantization!r} needs 'layerwise' (or 'auto')",
            )
        )
    for key in ("kv_offloading_size", "kv_offloading_backend", "kv_transfer_config"):
        if key in v.engine_kwargs:
            out.append(
                (
                    f"{KEY}.engine_kwargs.{key}",
                    f"set {KEY}.kv_offload_gb (offload) or rollout.pd.* "
                    "(prefill/decode disaggregation) instead: the engine builds it from those",
                )
            )
    # engine arguments that the section's fields own (the engine is built from those fields)
    for key, field_name, why in (
        ("reload", "weight_reload", ""),
        ("kv_on_update", "kv_on_update", ""),
        ("quantization", "quantization", " (the canary and the weight-sync path depend on it)"),
        ("enable_return_routed_experts", "routing_replay", ""),
    ):
        if key in v.engine_kwargs:
            out.append((f"{KEY}.engine_kwargs.{key}", f"set {KEY}.{field_name} instead{why}"))
    for key in v.sampling_kwargs:
        if key in SAMPLING_OWNED:
            out.append((f"{KEY}.sampling_kwargs.{key}", SAMPLING_OWNED[key]))
    if cfg.current_placement() == "colocated":
        out.extend(colocated_problems(cfg))
    return out


def colocated_problems(cfg: RunConfig) -> list[tuple[str, str]]:
    """What a colocated engine (weights in place over CUDA IPC) cannot do."""
    v, out = cfg.rollout.vllm, []
    if v.quantization is not None:
        out.append(
            (
                f"{KEY}.quantization",
                f"{v.quantization} rollout re-quantizes through vLLM's layerwise "
                "reload, which the colocated IPC receive does not run; use placement=split",
            )
        )
    if v.weight_reload == "layerwise":
        out.append(
            (
                f"{KEY}.weight_reload",
                "colocated engines receive weights in place over CUDA IPC "
                f"(direct); use {KEY}.weight_reload=auto or placement=split",
            )
        )
    return out
