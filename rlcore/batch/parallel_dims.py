"""How the trainer's ranks split the work: data-parallel x context-parallel ranks (expert
parallelism borrows from both), as plain arithmetic. Torch-free, so the driver's step planning
(`rlcore.batch.step`, `rlcore.sft.dataset`) and validation use it without importing the trainer;
`rlcore.trainer.parallel` builds the device meshes from it.

Layout (world = ``dp * cp`` ranks, row-major)::

    rank = d * cp + c            d = data-parallel index (which micro-batches), c = context index
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ParallelDims:
    """How ``world`` ranks are split: ``dp * cp == world``, ``ep`` divides ``world``."""

    dp: int
    cp: int = 1
    ep: int = 1

    @property
    def world(self) -> int:
        return self.dp * self.cp

    @classmethod
    def from_config(cls, t, world_size: int) -> "ParallelDims":
        """``trainer.dp`` null means "whatever is left": ``world_size // cp``."""
        cp = int(getattr(t, "cp", 1) or 1)
        dp = getattr(t, "dp", None)
        dp = world_size // cp if dp is None else int(dp)
        dims = cls(dp=dp, cp=cp, ep=int(getattr(t, "ep", 1) or 1))
        if dims.world != world_size or world_size % dims.ep:
            raise ValueError(f"trainer mesh dp={dp} x cp={cp} (ep={dims.ep}) does not fit world_size={world_size}")
        return dims

    def data_rank(self, rank: int) -> int:
        """Index of the data shard (list of micro-batches) that ``rank`` trains on."""
        return rank // self.cp

    def cp_rank(self, rank: int) -> int:
        return rank % self.cp


def data_parallel_size(t) -> int:
    """Number of distinct micro-batch streams (``trainer.dp``, or ``world_size // cp``)."""
    return ParallelDims.from_config(t, t.world_size).dp


def shards_per_rank(shards: list, t) -> list:
    """Expand one shard per data-parallel rank to one per trainer rank: the ``cp`` ranks of a
    data-parallel group train on the same micro-batches (each on its slice of the sequence)."""
    dims = ParallelDims.from_config(t, t.world_size)
    return [shards[dims.data_rank(r)] for r in range(dims.world)]
