"""The rollout-engine interface: one contract, a transformers and a vLLM implementation.

An engine turns prompt token ids into sampled completions and reports, for every sampled token,
its logprob under the distribution actually sampled from (temperature and top-p applied) and the
policy version whose weights produced it. Weights arrive as named full tensors (see
:mod:`rlcore.weight_sync`); an update may land between two decode steps of requests in flight,
which then continue on the new weights with the new version on their later tokens.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable

if TYPE_CHECKING:  # type names only: validation imports this before torch loads
    import torch


@dataclass
class SamplingParams:
    """Per-request sampling settings."""

    max_new_tokens: int = 32
    temperature: float = 1.0
    top_p: float = 1.0
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None


@dataclass
class Generation:
    """One sampled completion."""

    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str  # "stop" | "length" | "abort"


class RolloutEngine(abc.ABC):
    """What the rollout actor needs from an inference engine."""

    policy_version: int = 0

    @abc.abstractmethod
    def generate(self, prompts: list[list[int]], params: SamplingParams, images=None) -> list[Generation]:
        """Sample one completion per prompt (batched). `images` (vision-language models): one list
        of uint8 [H, W, 3] arrays per prompt, whose image tokens the prompt holds expanded."""

    @abc.abstractmethod
    def score(self, prompt_ids: list[int], completion_ids: list[int]) -> list[float]:
        """Teacher-forced logprobs (temperature 1) of `completion_ids` after `prompt_ids`;
        the canary compares these with the trainer's."""

    @abc.abstractmethod
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy full (unsharded) tensors into the engine's parameters, by trainer name."""

    @abc.abstractmethod
    def set_version(self, version: int) -> None:
        """Mark the weights loaded so far as policy `version` (called after the last bucket)."""

    @abc.abstractmethod
    def state_dict(self) -> dict[str, torch.Tensor]:
        """The engine's current weights by trainer name (for tests and checks)."""

    def apply_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Load a complete set of new weights and mark them as policy `version`, atomically with
        respect to decode steps."""
        self.load_weights(named_tensors)
        self.set_version(version)

    def abort(self) -> None:
        """Finish requests in flight early with reason `abort` (default: nothing in flight)."""


class WeightSyncError(RuntimeError):
    """A weight update failed or timed out on the engine side. After a timeout the engine core
    may still be blocked inside NCCL: treat the engine as broken and restart its actor."""
