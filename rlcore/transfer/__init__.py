"""Weight-transfer transports: each a trainer-side sender and an engine-side receiver
(`rlcore.transfer.base`) over one `SyncPlan` (`rlcore.transfer.plan`), the same sync over three
wires. The names are the registry's (`rlcore.engine.registry.TRANSPORTS`, which engine takes
which); the run's is `registry.weight_transport(cfg)`; :data:`PAIRS` maps each to its classes.

- `broadcast` (`broadcast.py`): rlcore's own bucketed broadcast over a stand-alone weight group
  (gloo on CPU, NCCL on GPU) into the engine's `apply_weights`.
- `nccl` (`nccl.py`): vLLM's packed NCCL broadcast; the engine's workers join the trainer's group
  and receive in place (`init_weight_transfer` / `receive_weights`).
- `ipc` (`ipc.py`, colocated placement, trainer rank i and engine i on one GPU): every trainer rank
  fills a CUDA IPC buffer its engine reads (`receive_ipc`); no process group at all.

Ranks: the trainer's sending rank is 0; the rollout actor in slot j of the group takes
:func:`ranks_per_actor` ranks from :func:`first_rank` (one per engine worker over `nccl`, one per
actor over `broadcast`). The group holds the actors that serve (`actors.membership`): slot j is
the j-th of them, so a group re-formed without a dead actor, or with a restarted one back,
renumbers its ranks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlcore.engine.registry import weight_transport
from rlcore.transfer import broadcast, ipc, nccl
from rlcore.transfer.base import Receiver, Sender

if TYPE_CHECKING:
    from rlcore.config import RunConfig

PAIRS: dict[str, tuple[type[Sender], type[Receiver]]] = {
    "broadcast": (broadcast.Sender, broadcast.Receiver),
    "nccl": (nccl.Sender, nccl.Receiver),
    "ipc": (ipc.Sender, ipc.Receiver),
}
"""Transport name -> (trainer-side sender class, engine-side receiver class)."""


def pair_for(name: str) -> tuple[type[Sender], type[Receiver]]:
    """The (sender, receiver) classes of transport `name`; KeyError naming the known ones otherwise."""
    pair = PAIRS.get(name)
    if pair is None:
        raise KeyError(f"unknown weight transport {name!r}; choose one of {list(PAIRS)}")
    return pair


def sender_for(name: str) -> type[Sender]:
    return pair_for(name)[0]


def receiver_for(name: str) -> type[Receiver]:
    return pair_for(name)[1]


def ranks_per_actor(cfg: RunConfig) -> int:
    """Weight-group ranks of one rollout actor over the run's transport."""
    return receiver_for(weight_transport(cfg)).ranks_per_actor(cfg)


def first_rank(cfg: RunConfig, slot: int) -> int:
    """The first group rank of the rollout actor in `slot`: `1 + slot * ranks_per_actor`."""
    return 1 + slot * ranks_per_actor(cfg)


def world_size(cfg: RunConfig, engines: int | None = None) -> int:
    """Ranks of a weight group holding `engines` rollout actors (default: all of them):
    `1 + engines * ranks_per_actor`."""
    n = cfg.rollout.num_actors if engines is None else engines
    return 1 + n * ranks_per_actor(cfg)
