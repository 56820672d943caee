"""alphabet_sort: sort words alphabetically, over several turns.

Turn 1 gives a few words; each later turn adds more and asks for the sorted list of *all* words
so far. The answer of a turn is the completion's words (separated by spaces, commas or
newlines). Reward: the mean over turns of the normalised LCS between the answer and the
expected sorted list (a turn never answered scores 0), so partial orderings earn partial credit.
"""

from __future__ import annotations

import re
from typing import Any

from rlcore.envs.base import Message, register, rng_for
from rlcore.envs.multiturn import MultiTurnEnvironment
from rlcore.envs.reverse_text import lcs_length
from rlcore.envs.words import SHORT_WORDS
from rlcore.types import Task


def words_of(text: str) -> list[str]:
    return [w for w in re.split(r"[\s,;]+", text.strip().lower()) if w]


def sequence_score(answer: list[str], expected: list[str]) -> float:
    """LCS over words / max length: 1 for the exact list, partial credit otherwise."""
    if not answer and not expected:
        return 1.0
    return lcs_length(answer, expected) / max(len(answer), len(expected))


@register("alphabet_sort")
class AlphabetSort(MultiTurnEnvironment):
    """Args: `turns` (rounds, = max_turns), `first_words`/`words_per_turn` (how many words the
    first and each later round gives), `vocabulary` (space-separated words; default a built-in
    list of short words)."""

    trusted_reward = True  # word lists compared by longest common subsequence: nothing of the text is evaluated

    def __init__(
        self,
        seed: int = 0,
        turns: int = 2,
        first_words: int = 3,
        words_per_turn: int = 1,
        vocabulary: str = "",
        **kwargs,
    ):
        if turns < 1:
            raise ValueError(f"env.args.turns: must be >= 1, got {turns}")
        kwargs.setdefault("max_turns", turns)
        super().__init__(seed, **kwargs)
        self.vocab = sorted(set(vocabulary.split())) if vocabulary else list(SHORT_WORDS)
        if self.max_turns < turns:
            raise ValueError(f"env.args.max_turns: must be >= turns ({turns}), got {self.max_turns}")
        if first_words < 1 or words_per_turn < 1:
            raise ValueError("env.args.first_words/words_per_turn: must be >= 1")
        if first_words + (turns - 1) * words_per_turn > len(self.vocab):
            raise ValueError(
                f"env.args.vocabulary: needs at least {first_words + (turns - 1) * words_per_turn} "
                f"distinct words, has {len(self.vocab)}"
            )
        self.turns, self.first_words, self.words_per_turn = turns, first_words, words_per_turn

    def make_task(self, index: int, split: str) -> Task:
        rng = rng_for(self.seed, split, index)
        words = rng.sample(self.vocab, self.first_words + (self.turns - 1) * self.words_per_turn)
        rounds = [words[: self.first_words]] + [
            words[self.first_words + i * self.words_per_turn : self.first_words + (i + 1) * self.words_per_turn]
            for i in range(self.turns - 1)
        ]
        expected = [sorted(sum(rounds[: i + 1], [])) for i in range(self.turns)]
        return Task(
            id=f"alphabet_sort/{split}/{index}",
            messages=[{"role": "user", "content": "Sort: " + " ".join(rounds[0])}],
            answer=expected,
            info={"rounds": rounds},
        )

    def env_response(self, task: Task, history: list[Message], state: dict[str, Any]) -> tuple[list[Message], bool]:
        done_turns = sum(m["role"] == "assistant" for m in history)
        rounds = task.info["rounds"]
        if done_turns >= len(rounds):
            return [], True
        return [{"role": "user", "content": "Add: " + " ".join(rounds[done_turns])}], False

    def demonstration_turns(self, task: Task) -> list[str]:
        """Each turn answered with the sorted words so far."""
        return [" ".join(words) for words in task.answer]

    def score(self, task: Task, history: list[Message], state: dict[str, Any]) -> float:
        answers = [words_of(m["content"]) for m in history if m["role"] == "assistant"]
        return sum(sequence_score(a, e) for a, e in zip(answers, task.answer)) / len(task.answer)
