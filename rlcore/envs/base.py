"""The environment interface: tasks in, scored episodes out.

An environment owns a task dataset (train and eval splits) and a reward function. The episode
loop here is single-turn: render the task's messages through the tokenizer's chat template,
sample `group_size` completions, score each. Multi-turn and tool environments override
`run_group`.
"""

from __future__ import annotations

import abc
import random
from typing import Any, Iterator

from transformers import PreTrainedTokenizerBase

from rlcore.engine.base import RolloutEngine, SamplingParams
from rlcore.types import Group, Sample, Task


class Environment(abc.ABC):
    """A task distribution and its reward."""

    name: str = "env"

    def __init__(self, seed: int = 0):
        self.seed = seed

    @abc.abstractmethod
    def make_task(self, index: int, split: str) -> Task:
        """The `index`-th task of `split` (`train` or `eval`); deterministic in (seed, index)."""

    @abc.abstractmethod
    def reward(self, task: Task, completion: str) -> float:
        """Score one completion text in [0, 1] (or any real scale the algorithm accepts)."""

    def tasks(self, split: str = "train", start: int = 0) -> Iterator[Task]:
        """Endless, deterministic task stream; `start` resumes it."""
        index = start
        while True:
            yield self.make_task(index, split)
            index += 1

    def render(self, task: Task, tokenizer: PreTrainedTokenizerBase) -> list[int]:
        text = tokenizer.apply_chat_template(task.messages, add_generation_prompt=True, tokenize=False)
        return tokenizer(text, add_special_tokens=False).input_ids

    def run_groups(self, tasks: list[Task], group_size: int, engine: RolloutEngine,
                   tokenizer: PreTrainedTokenizerBase, params: SamplingParams) -> list[Group]:
        """Sample `group_size` completions per task in one engine batch and score them."""
        prompts = [self.render(t, tokenizer) for t in tasks]
        flat = [p for p in prompts for _ in range(group_size)]
        gens = engine.generate(flat, params)
        groups = []
        for ti, task in enumerate(tasks):
            samples = []
            for gen in gens[ti * group_size:(ti + 1) * group_size]:
                sample = Sample(
                    prompt_ids=prompts[ti], completion_ids=gen.token_ids, logprobs=gen.logprobs,
                    versions=gen.versions, loss_mask=[1] * len(gen.token_ids),
                    finish_reason=gen.finish_reason,
                )
                text = tokenizer.decode(gen.token_ids, skip_special_tokens=True)
                try:
                    sample.reward = float(self.reward(task, text))
                except Exception as exc:  # reward code is user code: count the failure, go on
                    sample.failed, sample.error = True, f"reward: {type(exc).__name__}: {exc}"
                samples.append(sample)
            groups.append(Group(task=task, samples=samples))
        return groups


def rng_for(seed: int, split: str, index: int) -> random.Random:
    """A private RNG per task, so task `index` is the same whatever was drawn before it."""
    return random.Random(f"{seed}:{split}:{index}")


_REGISTRY: dict[str, type[Environment]] = {}


def register(name: str):
    def wrap(cls: type[Environment]) -> type[Environment]:
        cls.name = name
        _REGISTRY[name] = cls
        return cls
    return wrap


def registered() -> dict[str, type[Environment]]:
    import rlcore.envs  # noqa: F401  (registers the builtin environments)
    return dict(_REGISTRY)


def make_env(name: str, args: dict[str, Any], seed: int) -> Environment:
    envs = registered()
    if name not in envs:
        raise KeyError(f"env.name: unknown environment {name!r}; choose one of {sorted(envs)}")
    return envs[name](seed=seed, **args)
