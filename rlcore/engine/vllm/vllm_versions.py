"""Per-token policy versions of vLLM requests in flight.

Versions. Every token carries the policy version of the weights that produced it. A weight update
pauses the scheduler in "keep" mode (requests stay queued), swaps the weights, bumps the version
and resumes. The version boundary of each in-flight request is its token count at the bump, read
from vLLM's output processor (``output_mode="final"``, the default: one output per request, so the
client process does no per-token work beyond vLLM's own) or from the tokens streamed so far plus
those pending in the request's collector (``output_mode="delta"``: public API only, but a Python
object per request per decode step; measured 0.62x of raw vLLM throughput). The bump happens after
the whole weight update has been awaited, by which time every output produced before the pause has
been processed (the engine core sends all of them before answering the pause, and the output
handler runs on this loop during the update's awaits).

:class:`InFlightRequest` keeps one request's tokens and the version marks (first token index,
version) updates left on it; :class:`VersionMarks` is the engine's side (mixed into
:class:`rlcore.engine.vllm.vllm_engine.VLLMEngine`, whose ``_active``, ``_llm``, ``_version`` and
``output_mode`` it reads).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rlcore.engine.base import Generation


@dataclass
class InFlightRequest:
    """Book-keeping of one in-flight request."""

    rid: str
    version: int
    collector: Any = None  # vLLM RequestOutputCollector, once add_request returned
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    marks: list[tuple[int, int]] = field(default_factory=list)  # (first token index, version)
    mark_i: int = 0
    finished: bool = False
    finish_reason: str = "abort"
    routed_experts: Any = None  # routing replay: [prompt + completion - 1, layers, top_k], on finish
    kv_transfer_params: Any = None  # a prefill for remote decode: where its KV blocks wait (NIXL), on finish
    prompt_len: int | None = None  # the prompt vLLM ran (an image prompt as vLLM expanded it)

    def pending_tokens(self) -> int:
        """Tokens the output handler has delivered to the collector but we have not read yet."""
        out = getattr(self.collector, "output", None)
        outputs = getattr(out, "outputs", None)
        return len(outputs[0].token_ids) if outputs else 0

    def absorb(self, out: Any) -> None:
        """Append one output's tokens and logprobs; each token's version is the one of the last
        mark at or before its index. Whole runs of tokens are appended at once: in "final" mode
        one output carries every token of a request, and a per-token Python loop was 65k
        iterations per batch of 256 requests x 256 tokens."""
        comp = out.outputs[0]
        if self.prompt_len is None and getattr(out, "prompt_token_ids", None) is not None:
            self.prompt_len = len(out.prompt_token_ids)
        tokens = list(comp.token_ids)
        start = len(self.token_ids)
        end = start + len(tokens)
        self.token_ids.extend(tokens)
        self.logprobs.extend(sampled_logprobs(tokens, comp.logprobs))
        pos = start
        while self.mark_i < len(self.marks) and self.marks[self.mark_i][0] < end:
            first = max(self.marks[self.mark_i][0], pos)
            self.versions.extend([self.version] * (first - pos))
            pos = first
            self.version = self.marks[self.mark_i][1]
            self.mark_i += 1
        self.versions.extend([self.version] * (end - pos))
        if out.finished:
            self.finished = True
            self.finish_reason = finish_reason_of(comp.finish_reason)
            # with enable_return_routed_experts vLLM concatenates the request's routing into its
            # final output only (v1/engine/output_processor.py); None otherwise
            self.routed_experts = getattr(comp, "routed_experts", None)
            self.kv_transfer_params = getattr(out, "kv_transfer_params", None)

    def expansion_problem(self, expanded_len: int) -> str | None:
        """Why this image request's tokens do not line up with the sample's prompt of
        `expanded_len` tokens (placeholders expanded by rlcore): vLLM expanded it to another
        length, so its routed experts (and the trainer's positions) would be shifted. None when
        they line up or vLLM did not say."""
        if self.prompt_len is None or self.prompt_len == expanded_len:
            return None
        return (
            f"vLLM expanded an image prompt to {self.prompt_len} tokens, rlcore's sample holds "
            f"{expanded_len}: the image token counts of rlcore's processor and vLLM's differ"
        )

    def result(self) -> Generation:
        return Generation(
            token_ids=self.token_ids,
            logprobs=self.logprobs,
            versions=self.versions,
            finish_reason=self.finish_reason,
            routed_experts=self.routed_experts,
        )


def finish_reason_of(reason: str | None) -> str:
    if reason in ("length", "abort"):
        return reason
    return "stop"  # "stop" (eos / stop token); vLLM's other reasons end the sample the same way


def sampled_logprobs(token_ids: list[int], lps: Any) -> list[float]:
    """Logprob of each sampled token from vLLM's per-position logprobs (``logprobs=0`` asks for
    the sampled token only). Fast path for ``FlatLogprobs`` with one entry per position."""
    if lps is None:
        raise RuntimeError("vLLM returned no logprobs; the request must set logprobs=0")
    flat = getattr(lps, "logprobs", None)
    if flat is not None and len(flat) == len(token_ids) == len(lps) and list(lps.token_ids) == token_ids:
        return list(flat)
    return [position[tok].logprob for tok, position in zip(token_ids, lps)]


class VersionMarks:
    """Version book-keeping of :class:`VLLMEngine` (see the module docstring)."""

    def _cache_salt(self) -> str:
        """Prefix-cache namespace of the current weights: a request only reuses cached KV blocks
        computed under the same policy version."""
        return f"rlcore-v{self._version}"

    def _tokens_so_far(self, req: InFlightRequest) -> int:
        """Tokens the engine has produced for ``req`` and this process has processed."""
        if self.output_mode == "delta":
            return len(req.token_ids) + req.pending_tokens()
        collector = req.collector
        if collector is None:  # add_request still in flight: nothing generated yet
            return len(req.token_ids)
        # vLLM's output processor keeps one state per unfinished request (by internal id) whose
        # detokenizer accumulates every output token even when only the final output is sent.
        state = self._llm.output_processor.request_states.get(collector.request_id)
        if state is not None:
            return state.detokenizer.num_output_tokens()
        return len(req.token_ids) + req.pending_tokens()  # finished; final output maybe unread

    def _bump_version(self, version: int) -> None:
        """Runs on the loop while paused: tokens after each request's current count are new."""
        for req in self._active.values():
            if not req.finished:
                req.marks.append((self._tokens_so_far(req), version))
        self._version = version
        self.policy_version = version
