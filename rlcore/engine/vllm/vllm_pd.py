"""Prefill/decode disaggregation on vLLM (`rollout.pd.*`, connector `nixl`): the engine
arguments of a disaggregated engine and NIXL's request flow, as the vLLM engine uses them.

The flow (vLLM's NixlConnector): the prefill engine runs each prompt with `max_tokens=1` and
`kv_transfer_params` asking for a remote decode; it keeps the prompt's KV blocks and its output
returns the params that locate them (engine id, block ids, host, port). The decode engine's
request carries those params: its scheduler pulls the blocks over NIXL before decoding. rlcore's
router (`actors.pd_router`) hands the params from one engine to the other through Ray's object
store. vLLM is imported by the engine only; this module holds plain data.
"""

from __future__ import annotations

from typing import Any

from rlcore.engine.base import Generation, Prefilled

KV_CONNECTORS = {"nixl": "NixlConnector"}
"""`rollout.pd.connector` -> vLLM's KV connector class."""
REMOTE_DECODE = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                 "remote_block_ids": None, "remote_host": None, "remote_port": None}
"""A prefill request's `kv_transfer_params`: keep the KV blocks for a decode engine to pull."""


def kv_transfer_config(connector: str) -> dict[str, Any]:
    """vLLM's `kv_transfer_config` of a disaggregated engine: `kv_both` (either role; rlcore's
    router decides which engine prefills), the connector by name (NIXL's side-channel port comes
    from `VLLM_NIXL_SIDE_CHANNEL_PORT`, set per actor: `rlcore.plan.pd.connector_env`)."""
    return {"kv_connector": KV_CONNECTORS[connector], "kv_role": "kv_both"}


def prefill_overrides() -> dict[str, Any]:
    """vLLM `SamplingParams` fields of a prefill request (NIXL: one token, blocks kept)."""
    return {"max_tokens": 1, "extra_args": {"kv_transfer_params": dict(REMOTE_DECODE)}}


def decode_overrides(prefilled: Prefilled, index: int) -> dict[str, Any]:
    """vLLM `SamplingParams` fields of the decode request of prompt `index` of `prefilled`."""
    return {"extra_args": {"kv_transfer_params": prefilled.state[index]}}


def prefilled_handle(prompts: list[list[int]], reqs: list) -> Prefilled:
    """The handle of finished prefill requests (`InFlightRequest`s, one per prompt): each one's
    `kv_transfer_params`, and the oldest version that computed them."""
    missing = [i for i, r in enumerate(reqs) if not r.kv_transfer_params]
    if missing:
        raise RuntimeError(f"prefill: vLLM returned no kv_transfer_params for prompt(s) {missing} (is the engine "
                           "started with a kv_transfer_config?)")
    version = min((r.versions[0] if r.versions else r.version) for r in reqs)
    return Prefilled([list(p) for p in prompts], version, [r.kv_transfer_params for r in reqs])


def from_prefill_version(gens: list[Generation], prefilled: Prefilled) -> list[Generation]:
    """Decoded generations whose first token carries the prefill's version when it is older (the
    cache it attends to came from those weights: the sample's staleness counts from its prefill)."""
    for g in gens:
        if g.versions:
            g.versions[0] = min(g.versions[0], prefilled.version)
    return gens
