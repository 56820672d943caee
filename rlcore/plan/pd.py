"""Whether a prefill/decode disaggregated rollout group (`rollout.pd.*`) can run, before Ray starts.

The pools: prefill (`rollout.pd.prefill_*`) and decode (the rollout actors). What is refused, one
line each: a connector the engine does not disaggregate over, or whose package is missing on this
machine (named); a pool with no engines; GPU engines without GPUs; colocated placement (a trainer
rank shares each engine's GPU: the pools have no GPU of their own); pools sharing a GPU over a
connector that cannot move a cache between two processes of one device. KV offload's host memory
(`rollout.vllm.kv_offload_gb`) is counted against the node's RAM by `offload_problems`.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

from rlcore.config import RunConfig
from rlcore.config.pd import PD_CONNECTORS
from rlcore.engine.registry import engine_names, engine_options, engine_spec, has_option, option, option_key


@dataclass(frozen=True)
class Connector:
    """What the plan knows of one `rollout.pd.connector`."""

    module: str | None
    """The Python module it needs in the engine's process (None: nothing beyond rlcore's own)."""
    package: str | None
    """The package that provides it (what the refusal tells the user to install)."""
    shares_device: bool
    """Whether it moves a cache between two processes on one GPU (pools whose bundles share one)."""


CONNECTORS = {
    "object_store": Connector(None, None, True),  # tensors through Ray's object store: any device
    # NIXL's UCX backend moves GPU memory between two processes of one device over CUDA IPC;
    # benchmarks/gpu_pd.sh is the measurement on one GPU (docs/benchmarks.md)
    "nixl": Connector("nixl", "nixl-cu13 (or nixl)", True),
}
assert set(CONNECTORS) == set(PD_CONNECTORS)

PD = "rollout.pd"


def pd_on(cfg: RunConfig) -> bool:
    """Whether the run's rollout group is disaggregated (an SFT run has no rollout group)."""
    return cfg.rollout.pd.enabled and cfg.mode != "sft"


def pd_problems(cfg: RunConfig) -> list[tuple[str, str]]:
    """The config's own problems with `rollout.pd.*` (none when it is off)."""
    r, p = cfg.rollout, cfg.rollout.pd
    if not pd_on(cfg) or r.engine not in engine_names():
        return []
    out: list[tuple[str, str]] = []
    spec = engine_spec(r.engine)
    if p.connector in PD_CONNECTORS and p.connector not in spec.pd_connectors:
        out.append(
            (
                f"{PD}.connector",
                f"the {r.engine} engine disaggregates over "
                f"{' or '.join(spec.pd_connectors) or 'no connector'}, got {p.connector!r}",
            )
        )
    if p.prefill_actors < 1:
        out.append((f"{PD}.prefill_actors", f"the prefill pool needs at least one engine, got {p.prefill_actors}"))
    if r.num_actors < 1:
        out.append(
            (
                "rollout.num_actors",
                f"the decode pool (the rollout actors) needs at least one engine, got {r.num_actors}",
            )
        )
    tp = p.prefill_tensor_parallel_size  # each value's own bound is on its field (rlcore.config.bounds)
    if tp > 1 and not has_option(r, "tensor_parallel_size"):
        out.append(
            (
                f"{PD}.prefill_tensor_parallel_size",
                f"the {r.engine} engine has no tensor parallelism; leave it at 1, got {tp}",
            )
        )
    if spec.needs_gpu and p.prefill_gpus_per_actor <= 0:
        out.append(
            (
                f"{PD}.prefill_gpus_per_actor",
                f"the {r.engine} engine runs on GPUs only: give the prefill "
                f"engines GPUs (>= prefill_tensor_parallel_size={tp}, or a share of one to sit beside a decode "
                f"engine)",
            )
        )
    elif spec.needs_gpu and 1 <= p.prefill_gpus_per_actor < tp:
        out.append(
            (
                f"{PD}.prefill_gpus_per_actor",
                f"a prefill engine of tensor_parallel_size={tp} needs {tp} GPUs, got {p.prefill_gpus_per_actor:g}",
            )
        )
    if option(r, "routing_replay", False):
        out.append(
            (
                f"{PD}.enabled",
                f"routing replay records each prompt's experts in the engine that samples it; "
                f"it does not cross a prefill/decode split: set {option_key(r, 'routing_replay')}=false",
            )
        )
    if offload_gib(cfg) > 0:
        out.append(
            (
                option_key(r, "kv_offload_gb"),
                f"vLLM's CPU offload is a KV connector of its own; beside "
                f"{PD}.connector both need vLLM's MultiConnector, which rlcore does not configure yet: use one "
                f"of the two",
            )
        )
    if cfg.current_placement() == "colocated":
        out.append(
            (
                f"{PD}.enabled",
                "prefill/decode pools have GPUs of their own; colocated placement gives every "
                "engine half of a trainer rank's GPU: use placement=split",
            )
        )
    shared = 0 < p.prefill_gpus_per_actor < 1 or 0 < r.gpus_per_actor < 1
    connector = CONNECTORS.get(p.connector)
    if shared and connector is not None and not connector.shares_device:
        out.append(
            (
                f"{PD}.connector",
                f"{p.connector} cannot move a KV cache between two processes of one GPU, and "
                f"the pools share GPUs (rollout.gpus_per_actor={r.gpus_per_actor:g}, "
                f"{PD}.prefill_gpus_per_actor={p.prefill_gpus_per_actor:g}): give each engine whole GPUs",
            )
        )
    if (
        shared
        and spec.memory_share_kwarg is not None
        and option(r, "engine_kwargs", {}).get(spec.memory_share_kwarg) is None
    ):
        out.append(
            (
                f"{option_key(r, 'engine_kwargs')}.{spec.memory_share_kwarg}",
                "a prefill and a decode engine sharing one GPU each size their memory from it: set the "
                "share of each (e.g. 0.4; both pools read the same engine_kwargs)",
            )
        )
    return out


def connector_package_problems(cfg: RunConfig) -> list[tuple[str, str]]:
    """The connector's package, where the run starts (checked unless it is a dry run: the plan
    is for other machines)."""
    if not pd_on(cfg) or cfg.dry_run:
        return []
    connector = CONNECTORS.get(cfg.rollout.pd.connector)
    if connector is None or connector.module is None or importlib.util.find_spec(connector.module) is not None:
        return []
    return [
        (
            f"{PD}.connector",
            f"{cfg.rollout.pd.connector} needs the Python package {connector.module!r} "
            f"(pip install {connector.package}), which is not installed",
        )
    ]


def offload_gib(cfg: RunConfig) -> float:
    """Host memory one rollout engine keeps for KV offload (GiB; 0 for engines without it)."""
    return float(option(cfg.rollout, "kv_offload_gb", 0.0) or 0.0)


def machine_ram_bytes() -> int | None:
    """This machine's physical memory (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


HOST_HEADROOM = 0.9
"""Share of a node's RAM that offload buffers may take together (the rest: the actors' own
processes, Ray's object store, the OS)."""


def offload_problems(cfg: RunConfig, engines_per_node: dict[int, int], ram_bytes: int | None) -> list[tuple[str, str]]:
    """`rollout.vllm.kv_offload_gb` x the rollout engines on each node (`engines_per_node`: plan node
    -> engines, both pools) against `ram_bytes`, one node's RAM; nothing when either is unknown."""
    gib = offload_gib(cfg)
    if gib <= 0 or not ram_bytes or not engines_per_node:
        return []
    node, engines = max(engines_per_node.items(), key=lambda kv: kv[1])
    need = gib * engines * 2**30
    if need <= HOST_HEADROOM * ram_bytes:
        return []
    return [
        (
            option_key(cfg.rollout, "kv_offload_gb"),
            f"{engines} engine(s) on node {node} x {gib:g} GiB of KV "
            f"offload = {need / 2**30:.1f} GiB of host memory; the node has {ram_bytes / 2**30:.1f} GiB (at most "
            f"{HOST_HEADROOM:.0%} of it for offload): lower it or spread the engines over more nodes "
            f"(cluster.memory_per_node_gib describes a node)",
        )
    ]


def rollout_pools(cfg: RunConfig) -> list[tuple[str, int, float, float]]:
    """The rollout group's pools in bundle (and actor) order: (role, engines, CPUs, GPUs of
    each). Without disaggregation one pool, `rollout`; with it `decode` (the rollout actors,
    actors 0..num_actors-1), then `prefill`."""
    r, p = cfg.rollout, cfg.rollout.pd
    if not pd_on(cfg):
        return [("rollout", r.num_actors, r.cpus_per_actor, r.gpus_per_actor)]
    return [
        ("decode", r.num_actors, r.cpus_per_actor, r.gpus_per_actor),
        ("prefill", p.prefill_actors, p.prefill_cpus_per_actor, p.prefill_gpus_per_actor),
    ]


def rollout_roles(cfg: RunConfig) -> list[str]:
    """The role of each rollout actor, by index (`rollout_pools` order)."""
    return [role for role, n, _, _ in rollout_pools(cfg) for _ in range(n)]


def pool_config(cfg: RunConfig, role: str) -> RunConfig:
    """The run's config as an actor of pool `role` sees it: a prefill actor's engine is built
    with the prefill pool's GPUs, CPUs and tensor parallelism (`make_engine` reads them from the
    rollout section); other roles get `cfg` itself."""
    if role != "prefill":
        return cfg
    import copy

    out = copy.deepcopy(cfg)
    r, p = out.rollout, out.rollout.pd
    r.gpus_per_actor, r.cpus_per_actor = p.prefill_gpus_per_actor, p.prefill_cpus_per_actor
    if has_option(r, "tensor_parallel_size"):
        setattr(engine_options(r), "tensor_parallel_size", p.prefill_tensor_parallel_size)
    return out


NIXL_PORT_BASE = 5600
"""First port of NIXL's side channel (`VLLM_NIXL_SIDE_CHANNEL_PORT`); engine i takes base + 16 i
(each TP worker takes one more), so engines on one host never collide."""


def connector_env(cfg: RunConfig, index: int) -> dict[str, str]:
    """Environment variables rollout actor `index` sets before its engine starts, for the connector."""
    if not pd_on(cfg) or cfg.rollout.pd.connector != "nixl":
        return {}
    return {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(NIXL_PORT_BASE + 16 * index)}
