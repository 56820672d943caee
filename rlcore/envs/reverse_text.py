"""reverse_text: reverse a string; reward is the normalised longest common subsequence."""

from __future__ import annotations

from rlcore.envs.base import Environment, register, rng_for
from rlcore.types import Task


def lcs_length(a: str, b: str) -> int:
    """Length of the longest common subsequence (O(len(a) * len(b)) dynamic programme)."""
    prev = [0] * (len(b) + 1)
    for ca in a:
        cur = [0]
        for j, cb in enumerate(b):
            cur.append(prev[j] + 1 if ca == cb else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


def lcs_ratio(completion: str, target: str) -> float:
    """``LCS(c, t) / max(|c|, |t|)``: 1 for an exact answer, partial credit for near misses, and
    a penalty for padding the answer with extra characters."""
    if not completion and not target:
        return 1.0
    return lcs_length(completion, target) / max(len(completion), len(target))


@register("reverse_text")
class ReverseText(Environment):
    """Prompt: a random string over `alphabet`; answer: the string reversed."""

    trusted_reward = True  # a longest common subsequence against a short answer: time and memory linear in the text

    def __init__(
        self,
        seed: int = 0,
        alphabet: str = "abcdefghijklmnopqrstuvwxyz",
        min_len: int = 3,
        max_len: int = 8,
        instruction: str = "",
        **common,
    ):
        super().__init__(seed, **common)
        if not alphabet:
            raise ValueError("env.args.alphabet: must not be empty")
        if not 1 <= min_len <= max_len:
            raise ValueError(f"env.args.min_len/max_len: need 1 <= min_len <= max_len, got {min_len}, {max_len}")
        self.alphabet, self.min_len, self.max_len, self.instruction = alphabet, min_len, max_len, instruction

    def make_task(self, index: int, split: str) -> Task:
        rng = rng_for(self.seed, split, index)
        text = "".join(rng.choice(self.alphabet) for _ in range(rng.randint(self.min_len, self.max_len)))
        return Task(
            id=f"reverse_text/{split}/{index}",
            messages=[{"role": "user", "content": self.instruction + text}],
            answer=text[::-1],
        )

    def reward(self, task: Task, completion: str) -> float:
        return lcs_ratio(completion.strip(), task.answer)
