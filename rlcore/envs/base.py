"""The environment interface: tasks in, scored episodes out.

An environment owns a task dataset (train and eval splits) and a reward function. The episode
loop here is single-turn: render the task's messages through the tokenizer's chat template,
sample `group_size` completions, score each. Multi-turn and tool environments derive from
:class:`rlcore.envs.multiturn.MultiTurnEnvironment`, which overrides `run_groups`.

Reward safety (every environment): scoring runs under a deadline (`reward_timeout_s`, in
`thread` or `process` isolation, see :mod:`rlcore.envs.safety`); an exception, a timeout or a
non-finite reward either marks the sample failed (`on_reward_error: fail`, the driver counts and
drops it) or scores it 0 with the error kept on `Sample.error` (`on_reward_error: zero`). These
three settings are ordinary `env.args` keys accepted by every environment.
"""

from __future__ import annotations

import abc
import math
import random
from typing import Any, Iterator

from transformers import PreTrainedTokenizerBase

from rlcore.engine.base import RolloutEngine, SamplingParams
from rlcore.envs.render import render_prompt
from rlcore.envs.safety import Outcome, call_many, check_safety_args
from rlcore.types import Group, Sample, Task

Message = dict[str, Any]


class Environment(abc.ABC):
    """A task distribution and its reward.

    Subclasses implement `make_task` and `reward` (single-turn), and forward unknown keyword
    arguments to this constructor so the common settings below work for every environment.
    """

    name: str = "env"
    uses_images: bool = False
    """True when tasks carry images (the policy must then be a vision-language model)."""

    def __init__(self, seed: int = 0, reward_timeout_s: float = 10.0, on_reward_error: str = "fail",
                 reward_isolation: str = "thread", eval_size: int = 64):
        check_safety_args(reward_timeout_s, on_reward_error, reward_isolation)
        if eval_size < 1:
            raise ValueError(f"env.args.eval_size: must be >= 1, got {eval_size}")
        self.seed = seed
        self.reward_timeout_s = float(reward_timeout_s)
        self.on_reward_error = on_reward_error
        self.reward_isolation = reward_isolation
        self._eval_size = int(eval_size)

    @property
    def eval_size(self) -> int:
        """Number of tasks in the eval split: `make_task(i, "eval")` for i < eval_size."""
        return self._eval_size

    def eval_tasks(self) -> list[Task]:
        """The whole eval split, in order (what an evaluation runner iterates)."""
        return [self.make_task(i, "eval") for i in range(self.eval_size)]

    @abc.abstractmethod
    def make_task(self, index: int, split: str) -> Task:
        """The `index`-th task of `split` (`train` or `eval`); deterministic in (seed, index)."""

    @abc.abstractmethod
    def reward(self, task: Task, completion: str) -> float:
        """Score one completion text in [0, 1] (or any real scale the algorithm accepts)."""

    def demonstration(self, task: Task) -> str | None:
        """A reference assistant reply for supervised warm-up, or None if the task has none
        (default: the task's answer when it is a string)."""
        return task.answer if isinstance(task.answer, str) else None

    def demonstration_turns(self, task: Task) -> list[Message] | None:
        """The reference turns that follow the task's messages in supervised warm-up: one
        assistant reply (`demonstration`) by default; a tool-using environment may give several
        (assistant tool calls, tool results, the final reply). None if the task has none."""
        demo = self.demonstration(task)
        return None if demo is None else [{"role": "assistant", "content": demo}]

    def tasks(self, split: str = "train", start: int = 0) -> Iterator[Task]:
        """Endless, deterministic task stream; `start` resumes it."""
        index = start
        while True:
            yield self.make_task(index, split)
            index += 1

    def render(self, task: Task, tokenizer: PreTrainedTokenizerBase) -> list[int]:
        return render_prompt(tokenizer, task.messages)

    def score(self, task: Task, history: list[Message], state: dict[str, Any]) -> float:
        """Reward of a finished episode. `history` is the task's messages followed by the
        episode's assistant (and environment) messages; `state` is the episode's state (empty
        for single-turn). Default: `reward` of the last assistant message."""
        last = next((m["content"] for m in reversed(history) if m["role"] == "assistant"), "")
        return self.reward(task, last)

    def score_all(self, jobs: list[tuple[Task, list[Message], dict[str, Any]]]) -> list[Outcome]:
        """`score` every (task, history, state) concurrently under the reward deadline."""
        outcomes = call_many([(self.score, job) for job in jobs], self.reward_timeout_s, self.reward_isolation)
        for o in outcomes:
            if o.ok:
                try:
                    o.value = float(o.value)
                    if not math.isfinite(o.value):
                        o.value, o.error = None, f"reward is not finite ({o.value})"
                except (TypeError, ValueError):
                    o.value, o.error = None, f"reward is not a number ({o.value!r})"
        return outcomes

    def apply_error(self, sample: Sample, error: str) -> None:
        """Record a reward/environment fault on `sample` per `on_reward_error`."""
        sample.error = error
        if self.on_reward_error == "fail":
            sample.failed = True
        sample.reward = 0.0

    def apply_outcome(self, sample: Sample, outcome: Outcome) -> None:
        if outcome.ok:
            sample.reward = outcome.value
        else:
            self.apply_error(sample, f"reward: {outcome.error}")

    def run_groups(self, tasks: list[Task], group_size: int, engine: RolloutEngine,
                   tokenizer: PreTrainedTokenizerBase, params: SamplingParams) -> list[Group]:
        """Sample `group_size` completions per task in one engine batch and score them."""
        prompts = [self.render(t, tokenizer) for t in tasks]
        images = [task_images(t, tokenizer) for t in tasks]
        if any(images):  # one image token per image -> the model's count (token ids stay exact)
            from rlcore.models.vision import expand_image_tokens
            prompts = [expand_image_tokens(p, im, tokenizer.rlcore_vision)[0] for p, im in zip(prompts, images)]
        flat = [p for p in prompts for _ in range(group_size)]
        extra = {"images": [im for im in images for _ in range(group_size)]} if any(images) else {}
        gens = engine.generate(flat, params, **extra)
        samples, jobs = [], []
        for i, gen in enumerate(gens):
            task = tasks[i // group_size]
            samples.append(Sample(
                prompt_ids=prompts[i // group_size], completion_ids=gen.token_ids, logprobs=gen.logprobs,
                versions=gen.versions, loss_mask=[1] * len(gen.token_ids), finish_reason=gen.finish_reason,
                images=images[i // group_size],
            ))
            text = tokenizer.decode(gen.token_ids, skip_special_tokens=True)
            jobs.append((task, [*task.messages, {"role": "assistant", "content": text}], {}))
        # reward code is user code: a fault is recorded on its sample and the run goes on
        for sample, outcome in zip(samples, self.score_all(jobs)):
            self.apply_outcome(sample, outcome)
        return [Group(task=t, samples=samples[ti * group_size:(ti + 1) * group_size])
                for ti, t in enumerate(tasks)]


def task_images(task: Task, tokenizer: PreTrainedTokenizerBase) -> list:
    """The task's images as uint8 arrays (paths loaded here, at the environment); an error when
    the policy cannot take images."""
    if not task.images:
        return []
    if getattr(tokenizer, "rlcore_vision", None) is None:
        raise ValueError(f"task {task.id} has images but the policy is a text-only model")
    from rlcore.models.vision import check_image, to_array
    out = [to_array(im) for im in task.images]
    for arr in out:
        check_image(arr, tokenizer.rlcore_vision)
    return out


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


def resolve_env(name: str) -> type[Environment] | None:
    """A registered name, or `package.module:ClassName` for a user's own environment (imported
    in every process that needs it, so it must be importable on the whole cluster)."""
    if ":" in name:
        import importlib
        module, _, attr = name.partition(":")
        try:
            cls = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError):
            return None
        return cls if isinstance(cls, type) and issubclass(cls, Environment) else None
    return registered().get(name)


def make_env(name: str, args: dict[str, Any], seed: int) -> Environment:
    cls = resolve_env(name)
    if cls is None:
        raise KeyError(f"env.name: unknown environment {name!r}; choose one of {sorted(registered())} "
                       "or give module:Class")
    return cls(seed=seed, **args)
