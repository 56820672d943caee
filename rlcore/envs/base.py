"""The environment interface: tasks in, scored episodes out.

Over 400 lines: the interface and its single-turn episode loop are one contract that every environment builds on.

An environment owns a task dataset (train and eval splits) and a reward function. The episode
loop here is single-turn: render the task's messages through the tokenizer's chat template,
sample `group_size` completions, score each. Multi-turn and tool environments derive from
:class:`rlcore.envs.multiturn.MultiTurnEnvironment`, which overrides `run_groups`.

Reward safety (every environment, set by its own section `env.reward`,
:class:`rlcore.config.reward.RewardRuntimeConfig`): scoring runs under a deadline per sample
(`timeout_s`, in `worker` (default: reused processes killed at an overrun,
:mod:`rlcore.isolation.reward_workers`), `thread` or `process` isolation, see
:mod:`rlcore.isolation.safety`); an exception, a timeout or a non-finite reward either marks the
sample failed (`on_error: fail`, the driver counts and drops it) or scores it 0 with the error kept
on `Sample.error` (`on_error: zero`). When more than `max_abandoned_threads` timed-out threads are
still running, scoring moves to `process` isolation (logged once) and stateful calls (`init_state`,
`env_response`) fail their request with one line. Each reward worker may grow by `memory_mb` MiB (a
call past it fails its sample, naming the bound); reward workers have no network unless `network`
is true. What the code prints is kept on `Sample.env_output`. Every reward is checked against the
environment's declared `reward_range` ([0, 1] unless the class or `env.args.reward_range` says
otherwise): one outside it fails its sample with that reason, whatever `on_error` says. An empty
completion is an answer: it is scored.

`stream_groups` gives a request's groups one by one, each once all its samples are scored (in
`worker` isolation, as the calls settle): the rollout actor streams them to the driver, so a
reward that hangs holds back its own group only.
"""

from __future__ import annotations

import abc
import dataclasses
import logging
import math
import os
import random
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Iterator

from rlcore.config.reward import MOVED, RewardRuntimeConfig, carry_moved, reward_runtime_problems
from rlcore.isolation.reward_workers import WorkerPool
from rlcore.isolation.safety import (
    OUTPUT_LIMIT,
    STUCK_AFTER_S,
    Outcome,
    call_many,
    threads_abandoned,
)
from rlcore.models.render import render_prompt
from rlcore.types import Group, Sample, Task

if TYPE_CHECKING:  # type names only: validation constructs environments before torch loads
    from transformers import PreTrainedTokenizerBase

    from rlcore.engine.base import RolloutEngine, SamplingParams

Message = dict[str, Any]
log = logging.getLogger("rlcore")


_WARNED: set[str] = set()  # old reward keywords said once per process, not once per environment built


class MovedToRewardSection:
    """An environment attribute from before `env.reward` (`self.reward_timeout_s`): reads and
    writes the field of the environment's `reward_runtime` it became (`MOVED`)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.field = MOVED[name]

    def __get__(self, env: Any, owner: type | None = None) -> Any:
        return self if env is None else getattr(env.reward_runtime, self.field)

    def __set__(self, env: Any, value: Any) -> None:
        setattr(env.reward_runtime, self.field, value)


class EnvironmentStalled(RuntimeError):
    """Too many of the environment's calls hang: its requests fail with this one line."""


class Environment(abc.ABC):
    """A task distribution and its reward.

    Subclasses implement `make_task` and `reward` (single-turn), and forward unknown keyword
    arguments to this constructor so `eval_size`, `reward_range` and the reward runtime's section
    (`reward_runtime`, from `env.reward`) reach every environment.
    """

    name: str = "env"
    uses_images: bool = False
    """True when tasks carry images (the policy must then be a vision-language model)."""
    reward_range: tuple[float, float] = (0.0, 1.0)
    """The rewards this environment can give, bounds included (a class declares its own;
    `env.args.reward_range: [lo, hi]` overrides it). A reward outside it is a failed sample."""
    reward_imports: tuple[str, ...] = ()
    """Modules the reward imports inside its calls (lazily): the reward workers' zygote imports
    them once, so a new worker does not pay the import on its first call."""
    default_reward_timeout_s: float = 10.0
    """The reward deadline when `env.reward.timeout_s` is unset (an environment whose calls run
    tests, like mini_swe, declares a longer one)."""
    trusted_reward: bool = False
    """The class's own reward is rlcore's code over plain strings (it evaluates nothing from the
    text, its memory is linear in it): with `env.reward.isolation` unset its calls run in threads
    of the rollout actor, not through the reward workers' boundary (a process per call: 0.40x the
    samples/s on the SmolLM2 recipe, measured before workers forked from the actor were let go;
    docs/benchmarks.md). Read from the declaring class only
    (:meth:`reward_isolation_default`): a subclass, which may change the reward, is not trusted
    unless it says so itself."""
    reward_zygote: bool = True
    """Start reward workers from a zygote that unpickled this environment in a fresh interpreter
    (`rlcore.isolation.reward_zygote`): it has the instance's attributes, not what the rollout actor
    put in module globals or class attributes at run time. False: fork them from the actor (they
    see all of it; each start then costs the actor two forks of itself, ~14 ms each)."""

    def __init__(
        self,
        seed: int = 0,
        reward_runtime: RewardRuntimeConfig | None = None,
        eval_size: int = 64,
        reward_range: Sequence[float] | None = None,
        *,
        reward_timeout_s: float | None = None,
        on_reward_error: str | None = None,
        reward_isolation: str | None = None,
        max_abandoned_threads: int | None = None,
        reward_memory_mb: int | None = None,
        reward_network: bool | None = None,
    ):
        """`reward_runtime`: the section `env.reward` (None = its defaults), kept as this
        environment's own copy (`isolation` moves to `process` past `max_abandoned_threads`); its
        unset `timeout_s` becomes the class's `default_reward_timeout_s`. The keywords after `*`
        are that section's fields under their names from before it existed (environments written
        then pass them): carried into it, one warning each per process."""
        runtime = RewardRuntimeConfig() if reward_runtime is None else dataclasses.replace(reward_runtime)
        old = {
            "reward_timeout_s": reward_timeout_s,
            "on_reward_error": on_reward_error,
            "reward_isolation": reward_isolation,
            "max_abandoned_threads": max_abandoned_threads,
            "reward_memory_mb": reward_memory_mb,
            "reward_network": reward_network,
        }
        for line in carry_moved({k: v for k, v in old.items() if v is not None}, runtime):
            if line not in _WARNED:
                _WARNED.add(line)
                log.warning("%s: %s", type(self).__name__, line.replace("env.args.", "keyword ", 1))
        if runtime.timeout_s is None:
            runtime.timeout_s = self.default_reward_timeout_s
        if runtime.isolation is None:
            runtime.isolation = self.reward_isolation_default()
        self.reward_runtime = runtime
        problems = reward_runtime_problems(runtime)
        if problems:
            raise ValueError("{}: {}".format(*problems[0]))
        self.reward_range = check_reward_range(self.reward_range if reward_range is None else reward_range)
        if eval_size < 1:
            raise ValueError(f"env.args.eval_size: must be >= 1, got {eval_size}")
        self.seed = seed
        self._eval_size = int(eval_size)
        self._reward_pool: WorkerPool | None = None  # `worker` isolation: forked on first use

    @classmethod
    def reward_isolation_default(cls) -> str:
        """Where reward calls run when `env.reward.isolation` is unset: `thread` for a class that
        declares `trusted_reward = True` in its own body, `worker` for every other (a subclass of
        a trusted environment included)."""
        return "thread" if cls.__dict__.get("trusted_reward", False) else "worker"

    # the section's fields under their names from before `env.reward` (environments read them)
    reward_timeout_s = MovedToRewardSection()
    on_reward_error = MovedToRewardSection()
    reward_isolation = MovedToRewardSection()
    max_abandoned_threads = MovedToRewardSection()
    reward_memory_mb = MovedToRewardSection()
    reward_network = MovedToRewardSection()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("_reward_pool", None)  # processes and pipes stay with the process that forked them
        return state

    def reward_pool(self) -> WorkerPool:
        """The environment's reward workers (`env.reward.isolation: worker`)."""
        if getattr(self, "_reward_pool", None) is None:
            self._reward_pool = WorkerPool(
                self,
                self.reward_runtime.workers or max(2, min(4, os.cpu_count() or 1)),
                self.reward_runtime.memory_mb,
                zygote=self.reward_zygote,
                network=self.reward_runtime.network,
            )
        return self._reward_pool

    @property
    def eval_size(self) -> int:
        """Number of tasks in the eval split: `make_task(i, "eval")` for i < eval_size."""
        return self._eval_size

    def split_size(self, split: str) -> int | None:
        """Tasks in `split` when it is a finite dataset (0: empty), None when tasks are generated
        without end. Validation refuses an empty split before anything starts."""
        return self.eval_size if split == "eval" else None

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

    def demonstration_messages(self, task: Task) -> list[Message] | None:
        """A whole reference conversation for supervised warm-up (`sft.dataset=env`): the task's
        messages and `demonstration(task)` as the assistant reply; None if there is none."""
        reply = self.demonstration(task)
        return None if reply is None else [*task.messages, {"role": "assistant", "content": reply}]

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

    def guarded(self, calls: list, what: str, stateful: bool = False) -> list[Outcome]:
        """`call_many` under the reward deadline and isolation. Past `max_abandoned_threads`
        hung threads, stateless calls (scoring) move to process isolation for good; stateful
        ones (`what` names them) raise EnvironmentStalled, as a forked child's state is lost."""
        isolation = self.isolation_for(calls, what, stateful)
        if isolation == "worker":
            return self.reward_pool().call_many(calls, self.reward_runtime.timeout_s)
        return call_many(calls, self.reward_runtime.timeout_s, isolation)

    def guarded_stream(self, calls: list, what: str) -> Iterator[tuple[int, Outcome]]:
        """`guarded` (stateless calls), as `(call index, outcome)` pairs in the order the calls
        settle where the isolation allows it (`worker`: an overrunning call delays its own outcome
        only); in call order, once all are in, otherwise."""
        isolation = self.isolation_for(calls, what, False)
        if isolation == "worker":
            yield from self.reward_pool().stream_many(calls, self.reward_runtime.timeout_s)
        else:
            yield from enumerate(call_many(calls, self.reward_runtime.timeout_s, isolation))

    def isolation_for(self, calls: list, what: str, stateful: bool) -> str:
        """Where `calls` run (`thread`, `process` or `worker`): the configured isolation, moved as
        `guarded` says."""
        runtime = self.reward_runtime
        # stateful calls mutate the episode's state in place: they run in threads whatever the setting
        isolation = "thread" if stateful else runtime.isolation
        # only threads that ignored the request to stop for STUCK_AFTER_S count (blocked in C)
        hung = threads_abandoned(STUCK_AFTER_S) if isolation == "thread" and runtime.timeout_s > 0 and calls else 0
        if hung > runtime.max_abandoned_threads:
            if stateful:
                raise EnvironmentStalled(
                    f"{what}: {hung} calls missed env.reward.timeout_s={runtime.timeout_s:g} and still run "
                    f"(threads cannot be killed; bound env.reward.max_abandoned_threads={runtime.max_abandoned_threads})"
                )
            log.warning(
                "%s: %d reward threads missed their deadline and still run; scoring moves to process "
                "isolation (killed at the deadline)",
                self.name,
                hung,
            )
            runtime.isolation = isolation = "process"
        if isolation == "worker":
            if runtime.timeout_s > 0 and all(self.reward_pool().accepts(fn) for fn, _ in calls):
                return "worker"
            return "process"  # not a method of this environment (or no deadline): a fork per call
        return isolation

    def score_all(self, jobs: list[tuple[Task, list[Message], dict[str, Any]]]) -> list[Outcome]:
        """`score` every (task, history, state) concurrently, each under the reward deadline."""
        outcomes = self.guarded([(self.score, job) for job in jobs], "score")
        for o in outcomes:
            as_reward(o)
        return outcomes

    def score_stream(self, jobs: list[tuple[Task, list[Message], dict[str, Any]]]) -> Iterator[tuple[int, Outcome]]:
        """`score_all`, as `(job index, outcome)` pairs as each call settles (`guarded_stream`); an
        environment that overrides `score_all` gets all its outcomes at once."""
        if type(self).score_all is not Environment.score_all:
            yield from enumerate(self.score_all(jobs))
            return
        for i, o in self.guarded_stream([(self.score, job) for job in jobs], "score"):
            yield i, as_reward(o)

    def apply_error(self, sample: Sample, error: str) -> None:
        """Record a reward/environment fault on `sample` per `env.reward.on_error`."""
        sample.error = error
        if self.reward_runtime.on_error == "fail":
            sample.failed = True
        sample.reward = 0.0

    def out_of_range(self, reward: float) -> str | None:
        """Why `reward` cannot be this environment's (outside its declared range), else None."""
        lo, hi = self.reward_range
        if lo <= reward <= hi:
            return None
        return (
            f"{reward:g} is outside the environment's declared range [{lo:g}, {hi:g}] "
            f"({type(self).__name__}.reward_range / env.args.reward_range)"
        )

    def set_reward(self, sample: Sample, reward: float) -> None:
        """`sample.reward = reward` when it is in the declared range; otherwise the sample fails
        with the reason, whatever `env.reward.on_error` says (never trained on)."""
        problem = self.out_of_range(reward)
        if problem is None:
            sample.reward = reward
            return
        self.apply_error(sample, f"reward: {problem}")
        sample.failed = True

    def apply_outcome(self, sample: Sample, outcome: Outcome) -> None:
        keep_output(sample, outcome)
        if outcome.ok:
            self.set_reward(sample, outcome.value)
        else:
            self.apply_error(sample, f"reward: {outcome.error}")

    def run_groups(
        self,
        tasks: list[Task],
        group_size: int,
        engine: RolloutEngine,
        tokenizer: PreTrainedTokenizerBase,
        params: SamplingParams,
    ) -> list[Group]:
        """Sample `group_size` completions per task in one engine batch and score them."""
        groups = dict(self._single_turn(tasks, group_size, engine, tokenizer, params))
        return [groups[i] for i in range(len(tasks))]

    def stream_groups(
        self,
        tasks: list[Task],
        group_size: int,
        engine: RolloutEngine,
        tokenizer: PreTrainedTokenizerBase,
        params: SamplingParams,
    ) -> Iterator[tuple[int, Group]]:
        """`run_groups`, as `(task index, Group)` pairs, each as soon as its group is whole (every
        sample scored), so a reward that hangs delays its own group only. An environment with an
        episode loop of its own (it overrides `run_groups`) yields its groups once all are done."""
        if type(self).run_groups is not Environment.run_groups:
            yield from enumerate(self.run_groups(tasks, group_size, engine, tokenizer, params))
        else:
            yield from self._single_turn(tasks, group_size, engine, tokenizer, params)

    def _single_turn(
        self,
        tasks: list[Task],
        group_size: int,
        engine: RolloutEngine,
        tokenizer: PreTrainedTokenizerBase,
        params: SamplingParams,
    ) -> Iterator[tuple[int, Group]]:
        prompts = [self.render(t, tokenizer) for t in tasks]
        images = [task_images(t, tokenizer) for t in tasks]
        if any(images):  # one image token per image -> the model's count (token ids stay exact)
            from rlcore.models.images import expand_image_tokens  # numpy: not in every reward worker's fork

            prompts = [expand_image_tokens(p, im, tokenizer.rlcore_vision)[0] for p, im in zip(prompts, images)]
        flat = [p for p in prompts for _ in range(group_size)]
        extra = {"images": [im for im in images for _ in range(group_size)]} if any(images) else {}
        gens = engine.generate(flat, params, **extra)
        samples, jobs = [], []
        for i, gen in enumerate(gens):
            task = tasks[i // group_size]
            samples.append(
                Sample(
                    prompt_ids=prompts[i // group_size],
                    completion_ids=gen.token_ids,
                    logprobs=gen.logprobs,
                    versions=gen.versions,
                    loss_mask=[1] * len(gen.token_ids),
                    finish_reason=gen.finish_reason,
                    images=images[i // group_size],
                    routed_experts=gen.routed_experts,
                )
            )
            text = tokenizer.decode(gen.token_ids, skip_special_tokens=True)
            jobs.append((task, [*task.messages, {"role": "assistant", "content": text}], {}))
        unscored = [group_size] * len(tasks)
        # reward code is user code: a fault is recorded on its sample and the run goes on
        for j, outcome in self.score_stream(jobs):
            self.apply_outcome(samples[j], outcome)
            ti = j // group_size
            unscored[ti] -= 1
            if unscored[ti] == 0:
                yield ti, Group(task=tasks[ti], samples=samples[ti * group_size : (ti + 1) * group_size])


def as_reward(o: Outcome) -> Outcome:
    """`o` with its value made a float reward, or failed when it is none (not a finite number)."""
    if o.ok:
        try:
            o.value = float(o.value)
            if not math.isfinite(o.value):
                o.value, o.error = None, f"reward is not finite ({o.value})"
        except (TypeError, ValueError):
            o.value, o.error = None, f"reward is not a number ({o.value!r})"
    return o


def check_reward_range(value: Sequence[float]) -> tuple[float, float]:
    """`value` as (lo, hi), or ValueError naming `env.args.reward_range`."""
    try:
        lo, hi = (float(v) for v in value)
    except (TypeError, ValueError):
        raise ValueError(f"env.args.reward_range: must be [lo, hi] (numbers), got {value!r}") from None
    if math.isnan(lo) or math.isnan(hi) or not lo <= hi:
        raise ValueError(f"env.args.reward_range: must be [lo, hi] with lo <= hi, got {value!r}")
    return lo, hi


def keep_output(sample: Sample, outcome: Outcome) -> None:
    """Append what a call printed to the sample's bounded `env_output`."""
    if outcome.output:
        text = sample.env_output + outcome.output
        if len(text) > OUTPUT_LIMIT + 200:  # each call's output is bounded already; so is their sum
            text = text[:OUTPUT_LIMIT] + "\n[... output cut]"
        sample.env_output = text


def task_images(task: Task, tokenizer: PreTrainedTokenizerBase) -> list:
    """The task's images as uint8 arrays (paths loaded here, at the environment); an error when
    the policy cannot take images."""
    if not task.images:
        return []
    if getattr(tokenizer, "rlcore_vision", None) is None:
        raise ValueError(f"task {task.id} has images but the policy is a text-only model")
    from rlcore.models.images import check_image, to_array  # numpy: see above

    out = [to_array(im) for im in task.images]
    for arr in out:
        check_image(arr, tokenizer.rlcore_vision)
    return out


def rng_for(seed: int, split: str, index: int) -> random.Random:
    """A private RNG per task, so task `index` is the same whatever was drawn before it."""
    return random.Random(f"{seed}:{split}:{index}")


ENV_CLASSES: dict[str, type[Environment]] = {}


def register(name: str):
    def wrap(cls: type[Environment]) -> type[Environment]:
        cls.name = name
        ENV_CLASSES[name] = cls
        return cls

    return wrap
