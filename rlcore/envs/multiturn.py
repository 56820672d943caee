"""Multi-turn episodes: the policy and the environment take turns, batched over a group.

Token contract (what the trainer relies on), for every sample of a multi-turn episode:

- `prompt_ids` are the first turn's prompt; they and every sampled token are never re-tokenized.
- `completion_ids` holds, in order, each policy turn's sampled ids followed by the environment's
  reply ids (see :class:`rlcore.models.render.TurnRenderer`). The prompt of turn k+1 is exactly
  `prompt_ids + completion_ids` as they stood after turn k's reply.
- policy tokens: loss_mask 1, the engine's logprob and policy version;
  environment tokens: loss_mask 0, logprob 0.0, version -1.

Each turn is one engine batch over every episode still running (all samples of all tasks of
the request). An episode ends when the environment says done, after `max_turns` policy turns,
when the engine aborts, or when the next prompt would exceed `max_episode_tokens`.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from rlcore.envs.base import Environment, Message, keep_output
from rlcore.models.render import TurnRenderer
from rlcore.types import Group, Sample, Task

if TYPE_CHECKING:  # type names only: validation constructs environments before torch loads
    from transformers import PreTrainedTokenizerBase

    from rlcore.engine.base import Generation, RolloutEngine, SamplingParams


@dataclass
class Episode:
    """One running sample: its token streams, its message history and the env's state."""

    task: Task
    sample: Sample
    history: list[Message]
    state: dict[str, Any] = field(default_factory=dict)
    done: bool = False
    turns: int = 0

    @property
    def context(self) -> list[int]:
        """The ids the next policy turn is conditioned on."""
        return self.sample.prompt_ids + self.sample.completion_ids

    def add_policy(self, gen: Generation, text: str) -> None:
        s = self.sample
        s.completion_ids += gen.token_ids
        s.logprobs += gen.logprobs
        s.versions += gen.versions
        s.loss_mask += [1] * len(gen.token_ids)
        s.finish_reason = gen.finish_reason
        if gen.routed_experts is not None:  # the turn's prompt was the whole context: its rows cover all
            s.routed_experts = gen.routed_experts
        self.history.append({"role": "assistant", "content": text})
        self.turns += 1

    def add_env(self, ids: list[int], messages: list[Message]) -> None:
        s = self.sample
        s.completion_ids += ids
        s.logprobs += [0.0] * len(ids)
        s.versions += [-1] * len(ids)
        s.loss_mask += [0] * len(ids)
        self.history.extend(messages)


class MultiTurnEnvironment(Environment):
    """An environment that answers the policy until the episode is done.

    Subclasses implement `make_task`, `env_response` and `score` (or `reward` for the last
    assistant message); `init_state`/`cleanup` hold per-episode resources (a sandbox, a game).
    `env_response` runs under the reward deadline too: a fault or timeout ends the episode and is
    recorded per `env.reward.on_error`.
    """

    def __init__(self, seed: int = 0, max_turns: int = 4, max_episode_tokens: int = 0, **common):
        super().__init__(seed, **common)
        if max_turns < 1:
            raise ValueError(f"env.args.max_turns: must be >= 1, got {max_turns}")
        if max_episode_tokens < 0:
            raise ValueError(f"env.args.max_episode_tokens: must be >= 0 (0 = unlimited), got {max_episode_tokens}")
        self.max_turns = int(max_turns)
        self.max_episode_tokens = int(max_episode_tokens)

    def init_state(self, task: Task) -> dict[str, Any]:
        """Fresh per-episode state (called once per sample)."""
        return {}

    @abc.abstractmethod
    def env_response(self, task: Task, history: list[Message], state: dict[str, Any]) -> tuple[list[Message], bool]:
        """React to the last assistant message of `history`: (messages to append, done).
        Messages are rendered with the chat template as environment tokens; `done=True` ends
        the episode without them being sent."""

    def cleanup(self, state: dict[str, Any]) -> None:
        """Release per-episode resources (called once per sample, also after a fault)."""

    def demonstration_turns(self, task: Task) -> list[str] | None:
        """Reference assistant replies, one per turn, for supervised warm-up (None: none)."""
        return None

    def demonstration_messages(self, task: Task) -> list[Message] | None:
        """The episode the reference replies make: each reply is answered by this environment's
        own `env_response`, so the warm-up sees exactly the messages RL episodes see."""
        turns = self.demonstration_turns(task)
        if turns is None:
            return super().demonstration_messages(task)
        history = [dict(m) for m in task.messages]
        state = self.init_state(task)
        try:
            for i, reply in enumerate(turns):
                history.append({"role": "assistant", "content": reply})
                if i + 1 == len(turns):
                    break
                messages, done = self.env_response(task, history, state)
                if done:
                    break
                history.extend(messages)
        finally:
            self.cleanup(state)
        return history

    def reward(self, task: Task, completion: str) -> float:
        raise NotImplementedError(f"{type(self).__name__} scores whole episodes: override score()")

    def _fits(self, ep: Episode, extra: int, params: SamplingParams) -> bool:
        return not self.max_episode_tokens or len(ep.context) + extra + params.max_new_tokens <= self.max_episode_tokens

    def run_groups(
        self,
        tasks: list[Task],
        group_size: int,
        engine: RolloutEngine,
        tokenizer: PreTrainedTokenizerBase,
        params: SamplingParams,
    ) -> list[Group]:
        renderer = TurnRenderer(tokenizer)
        episodes = []
        for task in tasks:
            prompt = self.render(task, tokenizer)
            for _ in range(group_size):
                sample = Sample(prompt_ids=list(prompt), completion_ids=[], logprobs=[], versions=[], loss_mask=[])
                episodes.append(Episode(task, sample, [dict(m) for m in task.messages]))
        try:
            for ep, o in zip(
                episodes, self.guarded([(self.init_state, (ep.task,)) for ep in episodes], "init_state", stateful=True)
            ):
                keep_output(ep.sample, o)
                if o.ok:
                    ep.state = o.value
                else:
                    ep.done = True
                    self.apply_error(ep.sample, f"init_state: {o.error}")
            for turn in range(self.max_turns):
                running = [ep for ep in episodes if not ep.done]
                if not running:
                    break
                # a fixed request seed re-seeds the sampler every call: offset it per turn, or
                # every turn would draw the same random numbers (a random policy repeats its guess)
                turn_params = params if params.seed is None else replace(params, seed=params.seed + turn)
                self._policy_turn(running, engine, tokenizer, turn_params)
                if turn + 1 < self.max_turns:
                    self._env_turn([ep for ep in running if not ep.done], renderer, params)
            errored = {id(ep) for ep in episodes if ep.sample.error}
            to_score = [ep for ep in episodes if id(ep) not in errored]
            for ep, o in zip(to_score, self.score_all([(ep.task, ep.history, ep.state) for ep in to_score])):
                self.apply_outcome(ep.sample, o)
        finally:
            for ep in episodes:
                try:
                    self.cleanup(ep.state)
                except Exception:  # cleanup is best effort; the sample is already scored
                    pass
        return [
            Group(task=t, samples=[ep.sample for ep in episodes[i * group_size : (i + 1) * group_size]])
            for i, t in enumerate(tasks)
        ]

    def _policy_turn(
        self, running: list[Episode], engine: RolloutEngine, tokenizer: PreTrainedTokenizerBase, params: SamplingParams
    ) -> None:
        gens = engine.generate([ep.context for ep in running], params)
        for ep, gen in zip(running, gens):
            ep.add_policy(gen, tokenizer.decode(gen.token_ids, skip_special_tokens=True))
            if gen.finish_reason == "abort":
                ep.done = True

    def _env_turn(self, running: list[Episode], renderer: TurnRenderer, params: SamplingParams) -> None:
        calls = [(self.env_response, (ep.task, ep.history, ep.state)) for ep in running]
        for ep, o in zip(running, self.guarded(calls, "env_response", stateful=True)):
            keep_output(ep.sample, o)
            if not o.ok:
                ep.done = True
                self.apply_error(ep.sample, f"env_response: {o.error}")
                continue
            messages, done = o.value
            if done or not messages:
                ep.done = True
                continue
            ids = renderer.continuation(ep.sample.completion_ids, messages)
            if not self._fits(ep, len(ids), params):
                ep.done = True  # no room for another turn: the episode is scored as it stands
                ep.sample.finish_reason = "length"
                continue
            ep.add_env(ids, messages)
