"""Weight-transfer transports: the table of them, and the group's rank arithmetic.

A transport is a trainer-side sender (`rlcore.transfer.base.Sender`) over one `SyncPlan`
(`rlcore.transfer.plan`) and an engine-side receiver (`rlcore.weights.protocol.Receiver`).
:data:`PAIRS` maps each name to its :class:`TransportSpec`; :func:`register_transport` adds one
(from any package: a plug-in or a test), no file here changes.

- `broadcast` (`broadcast.py`): rlcore's own bucketed broadcast over a stand-alone weight group
  (gloo on CPU, NCCL on GPU). It has a receiver of its own, which lands the weights in any engine
  through `apply_weights`.
- `nccl` (`nccl.py`): vLLM's packed NCCL broadcast; the engine's workers join the trainer's
  group, one rank each, and receive in place.
- `ipc` (`ipc.py`, colocated placement, trainer rank i and engine i on one GPU): every trainer rank
  fills a CUDA IPC buffer its engine reads; no process group at all.

The receiving end of `nccl` and `ipc` lives inside the engine: an engine that takes them returns
its receiver from its one hook, `receiver(transport, seat)` (:func:`make_receiver` asks the
engine first, then falls back to the transport's own receiver). This package never imports an
engine module, and no engine module imports it: the two meet in `rlcore.weights.protocol`.
Which transport a run uses is the engine registry's answer (the caller's business, passed in by
name), and so is the number of workers per engine.

Ranks: the trainer's sending rank is 0; the rollout actor in slot j of the group takes
:func:`ranks_per_actor` ranks from :func:`first_rank` (one per engine worker over a transport
whose spec says `rank_per_worker`, else one per actor). The group holds the actors that serve
(`actors.membership`): slot j is the j-th of them, so a group re-formed without a dead actor, or
with a restarted one back, renumbers its ranks.

This module imports no torch (validation reads the table before torch loads): the classes are
named by import path and imported where a sender or receiver is built.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rlcore.weights.protocol import Receiver, ReceivingEngine, Seat, TransferOptions

if TYPE_CHECKING:
    from rlcore.config import RunConfig
    from rlcore.transfer.base import Sender
    from rlcore.transfer.plan import SyncPlan


@dataclass(frozen=True)
class TransportSpec:
    """What rlcore needs to know about one weight transport."""

    name: str
    """The name engines list in their `EngineSpec.transports`."""
    sender: str
    """`module:Class` of its :class:`rlcore.transfer.base.Sender`."""
    receiver: str | None = None
    """`module:Class` of its own receiver, built as `Receiver(seat, engine)` for an engine without
    one of its own (it lands weights through `apply_weights`); None: engines bring theirs."""
    rank_per_worker: bool = False
    """Each engine worker takes a rank of the group (the workers join it themselves); False: one
    rank per rollout actor."""


_BUILT_IN = (
    TransportSpec("broadcast", "rlcore.transfer.broadcast:Sender", receiver="rlcore.transfer.broadcast:Receiver"),
    TransportSpec("nccl", "rlcore.transfer.nccl:Sender", rank_per_worker=True),
    TransportSpec("ipc", "rlcore.transfer.ipc:Sender"),
)
PAIRS: dict[str, TransportSpec] = {}
"""Transport name -> its :class:`TransportSpec` (sender, own receiver if any, rank rule)."""


def register_transport(spec: TransportSpec) -> TransportSpec:
    """Add (or replace) a transport by name; returns `spec`."""
    for path in (spec.sender, spec.receiver):
        if path is not None and path.count(":") != 1:
            raise ValueError(f"transport {spec.name!r}: classes are named 'module:Class', got {path!r}")
    PAIRS[spec.name] = spec
    return spec


def unregister_transport(name: str) -> None:
    """Remove a registered transport (a test's or a plug-in's own clean-up)."""
    PAIRS.pop(name, None)


for _spec in _BUILT_IN:
    register_transport(_spec)


def transport_spec(name: str) -> TransportSpec:
    """The spec of transport `name`; KeyError naming the known ones otherwise."""
    spec = PAIRS.get(name)
    if spec is None:
        raise KeyError(f"unknown weight transport {name!r}; choose one of {list(PAIRS)}")
    return spec


def _load(path: str) -> Any:
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


def sender_for(name: str) -> type[Sender]:
    """The sender class of transport `name`."""
    return _load(transport_spec(name).sender)


def own_receiver(name: str) -> type[Receiver] | None:
    """The transport's own receiver class (for any engine); None when engines bring theirs."""
    path = transport_spec(name).receiver
    return None if path is None else _load(path)


def transfer_options(cfg: RunConfig) -> TransferOptions:
    """The transfer options of a run: `rollout.weight_sync_timeout_s`, `rollout.sync_bucket_mb`
    (in bytes), and the rollout actors' device (`cuda` when `rollout.gpus_per_actor` > 0)."""
    r = cfg.rollout
    return TransferOptions(
        timeout_s=float(r.weight_sync_timeout_s),
        bucket_bytes=int(r.sync_bucket_mb * 2**20),
        receive_device="cuda" if r.gpus_per_actor > 0 else "cpu",
    )


def make_sender(
    name: str, options: TransferOptions, plan: SyncPlan, device: str, address: str, port: int, world_size: int
) -> Sender:
    """Transport `name`'s sender, joined (as rank 0) to a group of `world_size` ranks."""
    return sender_for(name)(options, plan, device, address, port, world_size)


def make_receiver(
    name: str,
    options: TransferOptions,
    plan: SyncPlan,
    engine: ReceivingEngine,
    address: str,
    port: int,
    rank: int,
    world_size: int,
    handle: dict | None = None,
) -> Receiver:
    """A rollout actor's receiver of transport `name` for `engine`, joined at `rank`: the engine's
    own (`engine.receiver(name, seat)`), else the transport's own. ValueError when neither has one."""
    seat = Seat(name, options, address, port, rank, world_size, sender_for(name).layout(plan, options), handle)
    receiver = engine.receiver(name, seat)
    if receiver is not None:
        return receiver
    generic = own_receiver(name)
    if generic is None:
        raise ValueError(
            f"weight transport {name!r} has no receiver of its own and {type(engine).__name__} "
            f"returns none for it from receiver(); list only transports it receives in its EngineSpec"
        )
    return generic(seat, engine)


def ranks_per_actor(name: str, workers: int = 1) -> int:
    """Weight-group ranks of one rollout actor over transport `name`, whose engine runs
    `workers` workers (its tensor-parallel size): `workers` if `rank_per_worker`, else 1."""
    return workers if transport_spec(name).rank_per_worker else 1


def first_rank(name: str, slot: int, workers: int = 1) -> int:
    """The first group rank of the rollout actor in `slot`: `1 + slot * ranks_per_actor`."""
    return 1 + slot * ranks_per_actor(name, workers)


def world_size(name: str, engines: int, workers: int = 1) -> int:
    """Ranks of a weight group holding `engines` rollout actors: `1 + engines * ranks_per_actor`."""
    return 1 + engines * ranks_per_actor(name, workers)


def transport_problems(engine: str, transports: tuple[str, ...]) -> list[tuple[str, str]]:
    """(key, message) when engine `engine` lists a transport that is not registered."""
    missing = [t for t in transports if t not in PAIRS]
    if not missing:
        return []
    return [
        (
            "rollout.engine",
            f"engine {engine!r} receives weights over {missing}, which no registered "
            f"transport provides (registered: {list(PAIRS)}; see rlcore.transfer.register_transport)",
        )
    ]
