"""What a trainer rank's last optimizer step computed, kept until its next step: each micro-batch's
per-token logprobs from the step's own forward (under the weights before its update: the
"current" logprob of the importance ratio and of the mismatch metrics). The train step returns
metrics only; whoever wants these logprobs reads them between steps, for the samples it names
(the samples table: `actors.trainer.TrainerRank.last_step_logprobs`), with no extra forward.

Kept compact: one detached `[T]` copy per micro-batch on the step's device (a few bytes a token,
no host sync in the step) and the micro-batch's own `sample_index` (a reference, on the host).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable

import torch


@dataclass
class LastStep:
    """The logprobs of one finished step, per micro-batch."""

    version: int
    """The policy version the step made (its logprobs are of the version before it)."""
    logprobs: list[torch.Tensor]
    """Per micro-batch: the logprob of each packed position's next token ``[T]`` (position t scores
    token t + 1), detached, on the step's device."""
    sample_index: list[torch.Tensor]
    """Per micro-batch: the sample each packed position belongs to ``[T]`` (`MicroBatch.sample_index`)."""

    def segments(self, places: dict[Hashable, tuple[int, int]]) -> dict[Hashable, list[float]]:
        """For each `key -> (b, j)` of `places`: the logprobs along the packed positions of sample
        j of micro-batch b (its prompt, then its completion). One host copy per micro-batch read."""
        wanted: dict[int, list[tuple[Hashable, int]]] = {}
        for key, (b, j) in places.items():
            wanted.setdefault(b, []).append((key, j))
        out: dict[Hashable, list[float]] = {}
        for b, samples in wanted.items():
            host = self.logprobs[b].float().cpu()
            for key, j in samples:
                out[key] = host[self.sample_index[b] == j].tolist()
        return out
