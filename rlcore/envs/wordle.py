"""wordle: guess a hidden 5-letter word in at most `max_turns` guesses, with per-letter feedback.

Each turn the policy replies with a guess (the last 5-letter word in its reply). The environment
answers with the guess and its feedback, one mark per letter: `G` right letter in the right
place, `Y` in the word elsewhere, `-` not in the word (repeated letters are matched the way the
original game does: greens first, then yellows up to the letter's count). An unreadable guess
costs a turn and gets a reminder. Reward: 1 - 0.1 * (guesses - 1) when solved; otherwise
0.1 * (greens of the best guess) / 5, a small shaping signal.

Demonstrations (supervised warm-up): a solver that guesses, each turn, the first word of the
list (in `words` order) that agrees with all the feedback so far. `words` sets the difficulty:
the `wordle` recipe plays over a short list, which the tiny CPU policy can learn.
`demo_noise` weakens the demonstrator: each guess after its first is, with that probability, its
previous guess again (a wasted turn), so a policy that imitates it leaves RL something to learn:
stop repeating itself.
"""

from __future__ import annotations

import random
import re
from collections import Counter
from typing import Any

from rlcore.envs.base import Message, register, rng_for
from rlcore.envs.multiturn import MultiTurnEnvironment
from rlcore.envs.words import FIVE_LETTER_WORDS
from rlcore.types import Task

_WORD = re.compile(r"[a-z]{5}")


def feedback(guess: str, target: str) -> str:
    """Wordle marks of `guess` against `target` (both 5 lowercase letters)."""
    marks = ["-"] * 5
    left = Counter(t for g, t in zip(guess, target) if g != t)
    for i, (g, t) in enumerate(zip(guess, target)):
        if g == t:
            marks[i] = "G"
    for i, g in enumerate(guess):
        if marks[i] != "G" and left[g] > 0:
            marks[i] = "Y"
            left[g] -= 1
    return "".join(marks)


def parse_guess(text: str) -> str | None:
    """The last standalone 5-letter word of `text`, lowercased, or None."""
    found = [w for w in re.findall(r"[A-Za-z]+", text) if len(w) == 5]
    return found[-1].lower() if found else None


def solve(
    target: str, words: list[str], max_turns: int, noise: float = 0.0, rng: random.Random | None = None
) -> list[str]:
    """The solver's guesses: each the first of `words` consistent with every earlier mark; after
    the first, with probability `noise` (drawn from `rng`), the previous guess repeated instead."""
    guesses: list[str] = []
    candidates = list(words)
    while len(guesses) < max_turns and candidates:
        guess = guesses[-1] if guesses and noise and rng.random() < noise else candidates[0]
        guesses.append(guess)
        if guess == target:
            break
        marks = feedback(guess, target)
        candidates = [w for w in candidates if w != guess and feedback(guess, w) == marks]
    return guesses


def guesses_of(history: list[Message]) -> list[str | None]:
    return [parse_guess(m["content"]) for m in history if m["role"] == "assistant"]


@register("wordle")
class Wordle(MultiTurnEnvironment):
    """Args: `max_turns` (guesses, default 6), `words` (space-separated target list; default a
    built-in list of common words), `demo_noise` (the chance the demonstrator repeats its last guess)."""

    trusted_reward = True  # letters compared with the target: nothing of the text is evaluated
    PROMPT = "Wordle: guess the 5-letter word. Reply with one word. Marks: G=right spot, Y=wrong spot, -=absent."

    def __init__(self, seed: int = 0, words: str = "", max_turns: int = 6, demo_noise: float = 0.0, **kwargs):
        super().__init__(seed, max_turns=max_turns, **kwargs)
        if not 0.0 <= demo_noise <= 1.0:
            raise ValueError(f"env.args.demo_noise: must be in [0, 1], got {demo_noise}")
        self.demo_noise = float(demo_noise)
        self.words = sorted(set(words.lower().split())) if words else list(FIVE_LETTER_WORDS)
        bad = [w for w in self.words if not _WORD.fullmatch(w)]
        if bad or not self.words:
            raise ValueError(f"env.args.words: need 5-letter words a-z, got {bad[:3] or 'none'}")

    def make_task(self, index: int, split: str) -> Task:
        rng = rng_for(self.seed, split, index)
        target = rng.choice(self.words)
        return Task(id=f"wordle/{split}/{index}", messages=[{"role": "user", "content": self.PROMPT}], answer=target)

    def env_response(self, task: Task, history: list[Message], state: dict[str, Any]) -> tuple[list[Message], bool]:
        guess = parse_guess(history[-1]["content"])
        if guess == task.answer:
            return [], True
        if guess is None:
            return [{"role": "user", "content": "Invalid: reply with one 5-letter word."}], False
        return [{"role": "user", "content": f"{guess} {feedback(guess, task.answer)}"}], False

    def demonstration_turns(self, task: Task) -> list[str]:
        """The solver's guesses (see :func:`solve`), one word per turn; its repeats are drawn from
        the task's own RNG, so a demonstration is the same every time it is built."""
        return solve(
            task.answer, self.words, self.max_turns, self.demo_noise, random.Random(f"{self.seed}:demo-noise:{task.id}")
        )

    def score(self, task: Task, history: list[Message], state: dict[str, Any]) -> float:
        guesses = guesses_of(history)
        if task.answer in guesses:
            return max(0.0, 1.0 - 0.1 * guesses.index(task.answer))
        greens = [feedback(g, task.answer).count("G") for g in guesses if g]
        return 0.1 * max(greens, default=0) / 5
