"""Prefill/decode disaggregation on vLLM (`rollout.pd.*`, connector `nixl`): the engine
arguments of a disaggregated engine and NIXL's request flow, as the vLLM engine uses them.

The flow (vLLM's NixlConnector): the prefill engine runs each prompt with `max_tokens=1` and
`kv_transfer_params` asking for a remote decode; it keeps the prompt's KV blocks and its output
returns the params that locate them (engine id, block ids, host, port). The decode engine's
request carries those params: its scheduler pulls the blocks over NIXL before decoding. rlcore's
router (`actors.pd_router`) hands the params from one engine to the other through Ray's object
store. vLLM is imported by the engine only; this module holds plain data.

Versions (the rule every engine keeps, `rlcore.engine.base.StalePrefill`): a handle is of one
version (a prefill batch an update split is prefilled again); a decode request enters the engine
only while no update is under way and the engine holds the handle's version (its prefix-cache
salt is then the prefill's), and its first token, sampled here, must carry that version: the
cache of one version never meets the weights of another.
"""

from __future__ import annotations

from typing import Any

from rlcore.engine.base import Generation, Prefilled, StalePrefill

KV_CONNECTORS = {"nixl": "NixlConnector"}
"""`rollout.pd.connector` -> vLLM's KV connector class."""
REMOTE_DECODE = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
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
    `kv_transfer_params`, and the one version that computed them all. A batch a weight update
    split (its prompts' caches of two versions) raises `StalePrefill`: the engine prefills again."""
    missing = [i for i, r in enumerate(reqs) if not r.kv_transfer_params]
    if missing:
        raise RuntimeError(
            f"prefill: vLLM returned no kv_transfer_params for prompt(s) {missing} (is the engine "
            "started with a kv_transfer_config?)"
        )
    versions = {r.versions[0] if r.versions else r.version for r in reqs}
    if len(versions) > 1:
        raise StalePrefill(f"prefill: a weight update landed inside the batch (versions {sorted(versions)})")
    return Prefilled([list(p) for p in prompts], versions.pop(), [r.kv_transfer_params for r in reqs])


def admits(prefilled: Prefilled | None, version: int, updating: bool) -> None:
    """Raises `StalePrefill` unless a decode request of `prefilled` may enter an engine holding
    `version` now (`updating`: a weight update is under way, so the request could run on weights
    it lands). Checked on the engine's loop as the request is added: its prefix-cache salt and
    first version are read in the same step."""
    if prefilled is not None and (updating or version != prefilled.version):
        raise StalePrefill(
            f"prefill at version {prefilled.version}, this engine holds {version}"
            + (" and is receiving weights" if updating else "")
        )


def decoded_on_prefill_version(gens: list[Generation], prefilled: Prefilled) -> list[Generation]:
    """The decoded generations, after checking that each one's first token (sampled by this
    engine on the pulled cache) carries the prefill's version: an update that landed between
    the admission (`admits`) and the first decode step raises `StalePrefill` (decode again from
    a new prefill), so no sample continues a cache of one version on weights of another."""
    mixed = [i for i, g in enumerate(gens) if g.versions and g.versions[0] != prefilled.version]
    if mixed:
        raise StalePrefill(
            f"prefill at version {prefilled.version}, but prompt(s) {mixed} decoded their first token "
            f"at version {gens[mixed[0]].versions[0]} (a weight update landed meanwhile)"
        )
    return gens
