"""Turning one engine generation into an OpenAI chat-completions choice: stop strings, tool
calls, logprobs. The token ids kept are always a prefix of what the engine sampled."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rlcore.engine.base import Generation

if TYPE_CHECKING:  # type names only: validation imports this before torch loads
    from transformers import PreTrainedTokenizerBase


def truncate_at_stop(tokenizer: PreTrainedTokenizerBase, gen: Generation, stops: list[str]) -> tuple[Generation, str]:
    """OpenAI stop strings, applied after sampling: the reply text ends before the earliest stop
    string, the ids end with the token that completed it (the sampled ids up to there, as vLLM
    keeps them), finish reason `stop`. Without a hit: (gen, its text) unchanged."""
    text = tokenizer.decode(gen.token_ids, skip_special_tokens=True)
    hits = [(text.find(s), s) for s in stops if s and s in text]
    if not hits:
        return gen, text
    pos, stop = min(hits)
    end = pos + len(stop)

    def reaches(k: int) -> bool:  # monotone in k: a longer prefix decodes to a longer text
        return len(tokenizer.decode(gen.token_ids[:k], skip_special_tokens=True)) >= end

    lo, hi = 1, len(gen.token_ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if reaches(mid):
            hi = mid
        else:
            lo = mid + 1
    return Generation(
        token_ids=gen.token_ids[:lo], logprobs=gen.logprobs[:lo], versions=gen.versions[:lo], finish_reason="stop"
    ), text[:pos]


def logprobs_content(tokenizer: PreTrainedTokenizerBase, gen: Generation) -> list[dict[str, Any]]:
    """OpenAI `choices[i].logprobs.content`: one entry per sampled token (no alternatives)."""
    out = []
    for t, lp in zip(gen.token_ids, gen.logprobs):
        s = tokenizer.decode([t])
        out.append({"token": s, "logprob": lp, "bytes": list(s.encode("utf-8")), "top_logprobs": []})
    return out
