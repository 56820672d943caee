"""The rollout-engine interface: the whole contract an engine plug-in implements.

An engine turns prompt token ids into sampled completions and reports, for every sampled token,
its logprob under the distribution actually sampled from (temperature and top-p applied) and the
policy version whose weights produced it. An update may land between two decode steps of requests
in flight, which then continue on the new weights with the new version on their later tokens.

Weights arrive through a named transport (`rlcore.engine.registry` lists the ones each engine
takes; the transfer package's `PAIRS` is the table of transports). The engine's part is one hook,
:meth:`RolloutEngine.receiver`: for a transport it receives in its own way it returns its own
receiver (a `rlcore.weights.protocol.Receiver`, built from the `Seat` it is given: rendezvous,
ranks, what a sync holds, timeouts); otherwise None, and the transport's own receiver, if it has
one, lands the weights through :meth:`RolloutEngine.apply_weights`. So an engine that takes
`broadcast` writes nothing for it, and a transport whose receiving end runs inside the engine
(vLLM's workers over `nccl` or `ipc`) is received by the engine's own code. An engine never
imports a transport module, nor the reverse; they share only `rlcore.weights.protocol`.

Engines are built by :meth:`RolloutEngine.from_config` from their own config section and the
model config, not the whole run config; the registry names the class (`make_engine`).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable

if TYPE_CHECKING:  # type names only: validation imports this before torch loads
    import torch

    from rlcore.config import ModelConfig
    from rlcore.weights.protocol import Receiver, Seat


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
    routed_experts: Any = None
    """Routing replay: the experts of every token run through the model (the prompt and all but
    the last sampled token), integer [prompt + completion - 1, layers, top_k] (`rlcore.batch.routing`)."""


@dataclass
class Prefilled:
    """What a prefill engine hands a decode engine for one batch of prompts (prefill/decode
    disaggregation, `rollout.pd.*`): picklable, it travels through Ray's object store."""

    prompts: list[list[int]]
    """The prompts it was computed for (the decode call must pass the same ones)."""
    version: int
    """Policy version of the weights the prefill ran with (one for the whole batch). A decode
    engine continues the handle only on weights of this same version (:class:`StalePrefill`
    otherwise), so the sample's first tokens, and its staleness, carry this one version."""
    state: Any
    """The engine's own transfer handle: the transformers engine's KV cache and last-position
    logits; vLLM's NIXL `kv_transfer_params` of each prompt."""


class RolloutEngine(abc.ABC):
    """What the rollout actor needs from an inference engine."""

    policy_version: int = 0

    @classmethod
    @abc.abstractmethod
    def from_config(
        cls, options: Any, model: ModelConfig, *, seed: int = 0, tokenizer: Any = None, device: str = "cpu"
    ) -> "RolloutEngine":
        """Build the engine of `model` with its own config section `options` (`rollout.<section>`,
        or the teacher's; None for an engine without one) on `device` (`cuda` when its actor
        holds GPUs); `seed` seeds its own sampling RNG; `tokenizer` is the actor's (engines that
        need one may use it)."""

    @abc.abstractmethod
    def generate(self, prompts: list[list[int]], params: SamplingParams, images=None) -> list[Generation]:
        """Sample one completion per prompt (batched). `images` (vision-language models): one list
        of uint8 [H, W, 3] arrays per prompt, whose image tokens the prompt holds expanded.
        Engines that disaggregate also take `prefilled=` (a :class:`Prefilled` of these prompts,
        from :meth:`prefill`): they continue from its cache instead of computing the prompts, and
        raise :class:`StalePrefill` when the weights that first run on that cache are not of the
        handle's version (a sync landed between the prefill and the decode: prefill again)."""

    def prefill(self, prompts: list[list[int]], params: SamplingParams, images=None) -> Prefilled:
        """Prefill/decode disaggregation, prefill side (engines whose `EngineSpec.pd_connectors`
        is not empty): compute the prompts' KV cache and return the handle a decode engine of the
        same model continues from, `generate(prompts, params, images, prefilled=handle)`. With the
        same seed and greedy sampling that call returns what `generate(prompts, params)` would."""
        raise NotImplementedError(f"{type(self).__name__} does not disaggregate prefill and decode")

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

    def score_batch(self, pairs: list[tuple[list[int], list[int]]]) -> list[list[float]]:
        """:meth:`score` for several (prompt, completion) pairs (engines may batch them)."""
        return [self.score(list(p), list(c)) for p, c in pairs]

    def score_top_k_batch(self, pairs: list[tuple[list[int], list[int]]], k: int) -> list[tuple[list[float], Any, Any]]:
        """Per (prompt, completion) pair: the teacher-forced logprobs of :meth:`score`, and the
        engine's top-k next-token distribution at each completion position as two arrays
        ``[len(completion), k']`` (token ids int32, logprobs float32, temperature 1, largest first;
        ``k' = min(k, vocabulary)``). Engines that serve a teacher with `teacher.top_k` implement it
        and declare `EngineSpec.scores_top_k`."""
        raise NotImplementedError(f"{type(self).__name__} does not return top-k logprobs")

    def abort(self) -> None:
        """Finish requests in flight early with reason `abort` (default: nothing in flight)."""

    # ---- sampling RNG (resume): engines without an RNG of their own keep these defaults

    def rng_state(self) -> Any:
        """State of the engine's own sampling RNG (requests without a seed draw from it); None
        when the engine has none to save."""
        return None

    def set_rng_state(self, state: Any) -> bool:
        """Restore a state from :meth:`rng_state`; False when the engine has no such RNG."""
        return False

    # ---- weight receive (see the module docstring)

    def receiver(self, transport: str, seat: Seat) -> Receiver | None:
        """This engine's own receiver for `transport`, joined to its group at `seat` (building it
        joins, at the same time as the sender); None (the default): it has no receiver of its own,
        and the transport's own receiver delivers each sync through :meth:`apply_weights`."""
        return None

    # ---- profiling (`profile.steps`): by default torch.profiler records the actor's own process

    def start_profile(self, label: str, with_stack: bool = False, cpu_ops: bool = True) -> None:
        """Record this engine's GPU kernels (and CPU ops, `cpu_ops`) until :meth:`stop_profile`;
        `label` names the trace (e.g. `step3`). Engines whose work runs in processes of their own
        override both (and declare `EngineSpec.traced_elsewhere`)."""
        from rlcore.report.profiling import TraceRecorder

        if getattr(self, "_trace_recorder", None) is None:
            self._trace_recorder = TraceRecorder(with_stack, cpu_ops)
        self._trace_recorder.start(label)

    def stop_profile(self) -> list[tuple[str, bytes]]:
        """End the recording; its trace files as (name, Chrome trace bytes, gzipped or not)."""
        recorder = getattr(self, "_trace_recorder", None)
        return recorder.stop() if recorder is not None else []

    # ---- sleep mode (colocated engines that free their GPU memory while the trainer steps)

    def sleep(self, level: int) -> float:
        """Free the engine's GPU memory at `level`; returns seconds."""
        raise NotImplementedError(f"{type(self).__name__} has no sleep mode")

    def wake_up(self) -> float:
        """Take the memory back after :meth:`sleep`; returns seconds."""
        raise NotImplementedError(f"{type(self).__name__} has no sleep mode")


class StalePrefill(RuntimeError):
    """A decode engine refused a prefill handle: the weights its cache would meet are not of the
    handle's version (`Prefilled.version`). Nothing was decoded from it; prefill again."""


class WeightSyncError(RuntimeError):
    """A weight update failed or timed out on the engine side. After a timeout the engine core
    may still be blocked inside NCCL: treat the engine as broken and restart its actor."""
