"""Token ids for chat turns, without ever re-tokenizing what was already sampled.

The first prompt is the chat template applied to the task's messages. Every later turn is the
previous ids + the policy's completion ids + the ids of the *template delta* for the new
environment messages: the text the template adds after an assistant turn to render those
messages and open the next assistant turn. The delta is found by rendering a placeholder
conversation with and without the new messages and cutting after the assistant turn's
end-of-turn marker (`tokenizer.eos_token`, which is also where the engine stops sampling), so it
is right for any template that renders earlier turns the same whatever follows them (ChatML,
Llama 3, the built-in char template, ...). A template that is not is reported, not guessed at.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# A neutral conversation the delta is measured after; its contents never reach the policy.
_PLACEHOLDER = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]


def render_prompt(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]]) -> list[int]:
    """Ids of `messages` rendered with the chat template, ending with the assistant header."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False).input_ids


def _template(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]], gen: bool) -> str:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=gen, tokenize=False)


def env_turn_text(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]]) -> str:
    """The template text between the end-of-turn marker of an assistant turn and the first
    token the policy samples in its next turn, with `messages` rendered in between."""
    eos = tokenizer.eos_token
    if not eos:
        raise ValueError("multi-turn rendering needs tokenizer.eos_token (the assistant end-of-turn marker)")
    before = _template(tokenizer, _PLACEHOLDER, gen=False)
    after = _template(tokenizer, _PLACEHOLDER + list(messages), gen=True)
    n_eos = before.count(eos)
    cut = -1
    for _ in range(n_eos):  # the assistant turn ends at the n-th marker in both renderings
        cut = after.find(eos, cut + 1)
        if cut < 0:
            break
    delta = after[cut + len(eos) :] if n_eos and cut >= 0 else None
    # sanity check that the cut is where the new messages start (templates may restyle earlier
    # assistant turns, e.g. drop reasoning; only what follows the marker matters here)
    first = str(messages[0].get("content", "")).strip() if messages else ""
    if delta is None or (first and first not in delta):
        raise ValueError(
            f"cannot locate the environment turn after the assistant end-of-turn marker {eos!r} in "
            "this chat template; multi-turn episodes need the assistant turn to end with eos_token"
        )
    return delta


class TurnRenderer:
    """Renders environment messages as token ids that continue an episode.

    `continuation(completion_ids, messages)` returns the env tokens to append after a policy
    turn: the end-of-turn marker if the policy did not emit it (it hit the length cap), then the
    delta ids of `messages` and the next assistant header.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase):
        self.tokenizer = tokenizer
        self.eos_id = tokenizer.eos_token_id

    def continuation(self, completion_ids: list[int], messages: list[dict[str, Any]]) -> list[int]:
        ids = [] if completion_ids and completion_ids[-1] == self.eos_id else [self.eos_id]
        text = env_turn_text(self.tokenizer, messages)
        return ids + self.tokenizer(text, add_special_tokens=False).input_ids
