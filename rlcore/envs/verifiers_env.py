"""Run environments written with the `verifiers` package (classic API) against the rollout engine.

`env.name: verifiers`, `env.args.load: package.module:function`, where the function (called
with `env.args.env_kwargs`) returns a classic verifiers environment (`vf.SingleTurnEnv`,
`vf.MultiTurnEnv`, `vf.ToolEnv`, ... from `verifiers.legacy`, also reachable as
`import verifiers as vf` in the pinned 0.3.x). The v1 stack (`verifiers.v1`) is not supported.

Per `run_groups` call, on the rollout actor:

1. an :class:`~rlcore.serving.openai_server.OpenAIServer` (started once, loopback, ephemeral
   port) serves the engine over chat completions; its defaults are this call's SamplingParams;
2. the verifiers environment runs `group_size` rollouts per task with an OpenAI client pointed at
   it (`env.rollout`), then scores each group with its own rubric (`rubric.score_group`);
3. each rollout's trajectory names the responses it got; their token records become one
   :class:`Sample`: prompt ids of the first turn, then each turn's sampled ids (loss_mask 1, the
   engine's logprobs and versions) with the ids the server added between turns (environment
   tokens: loss_mask 0, logprob 0.0, version -1). The server's prefix rule makes every later turn
   extend the earlier one token for token; a rollout whose turns do not (the environment
   rewrote its history) cannot be one training sequence and is recorded as an error.

An empty completion (end-of-sequence at once) is an answer: verifiers' client would raise
`EmptyModelResponseError` for it; the client used here hands it on as an empty message instead,
so the rubric scores it (whatever low reward it gives empty text) and it is trained on.
A rollout that errors (verifiers puts the error on its state: a failing request, a timeout),
returns no reward, or a non-finite one, is handled per `on_reward_error`; one left without token
ids (no recorded model call) is always failed, as there is nothing to train on.
The verifiers rubric runs inside the verifiers rollout, under `rollout_timeout_s` (the whole
request), not under the per-reward `reward_timeout_s` of rlcore environments.

Limits: the rollouts use this call's max_new_tokens / temperature / top_p (the verifiers env's
own `sampling_args` are not merged in), and `SamplingParams.seed` is not forwarded (a per-request
seed would make a group's identical prompts sample identically), so verifiers episodes are not
reproducible by seed. The server answers text only: it does not parse tool calls, so `ToolEnv`
episodes see the policy's text but never call tools. Turns of concurrent episodes share an
engine batch when they reach the server within `batch_window_s` of each other.
"""

from __future__ import annotations

import asyncio
import importlib
import math
import random
import signal
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from rlcore.envs.base import Environment, register
from rlcore.types import Group, Sample, Task

if TYPE_CHECKING:  # rlcore.serving imports rlcore.envs: imported where used
    from transformers import PreTrainedTokenizerBase

    from rlcore.engine.base import RolloutEngine, SamplingParams
    from rlcore.serving.openai_server import OpenAIServer, TokenRecord


def load_verifiers_env(spec: str, kwargs: dict[str, Any] | None = None) -> Any:
    """`module:function` -> the verifiers environment the function returns."""
    module, sep, attr = spec.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"env.args.load: expected 'package.module:function', got {spec!r}")
    fn = getattr(importlib.import_module(module), attr)
    # classic verifiers environments install process-wide SIGINT/SIGTERM handlers when built
    # (their teardown, then exit); the actor's own handlers are put back (teardown still runs
    # at exit through the atexit hook they also register)
    main = threading.current_thread() is threading.main_thread()
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)} if main else {}
    try:
        vf_env = fn(**(kwargs or {}))
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
    if not (hasattr(vf_env, "rollout") and hasattr(vf_env, "rubric") and hasattr(vf_env, "get_dataset")):
        raise TypeError(f"env.args.load: {spec} returned {type(vf_env).__name__}, not a classic verifiers "
                        "Environment (verifiers.legacy / `import verifiers as vf`)")
    return vf_env


_CLIENT: list[type] = []


def empty_answers_client() -> type:
    """verifiers' chat-completions client, except that an empty reply (one choice, no content,
    no tool call) is returned as an empty assistant message for the rubric to score, where
    verifiers raises EmptyModelResponseError and the rollout would be lost (built once: verifiers
    is imported on first use)."""
    if not _CLIENT:
        from verifiers.legacy.clients import OpenAIChatCompletionsClient
        from verifiers.legacy.errors import EmptyModelResponseError

        class EmptyAnswersClient(OpenAIChatCompletionsClient):
            async def raise_from_native_response(self, response):
                try:
                    await super().raise_from_native_response(response)
                except EmptyModelResponseError:
                    if response is None or not response.choices or len(response.choices) != 1:
                        raise  # no reply at all: a fault, not an answer

            async def from_native_response(self, response):
                out = await super().from_native_response(response)
                if out.message.content is None and not out.message.tool_calls:
                    out.message.content = ""
                return out

        _CLIENT.append(EmptyAnswersClient)
    return _CLIENT[0]


def _plain(messages: Any) -> list[dict[str, Any]]:
    out = []
    for m in messages or []:
        if hasattr(m, "model_dump"):
            m = m.model_dump(exclude_none=True)
        out.append({k: v for k, v in dict(m).items() if v is not None})
    return out


def stitch(records: list[TokenRecord]) -> Sample:
    """One sample from a rollout's per-turn token records (raises ValueError when a turn's
    prompt does not extend the previous turn's ids)."""
    first = records[0]
    sample = Sample(prompt_ids=list(first.prompt_ids), completion_ids=[], logprobs=[], versions=[], loss_mask=[])
    for i, rec in enumerate(records):
        context = sample.prompt_ids + sample.completion_ids
        if i:
            if rec.prompt_ids[:len(context)] != context:
                raise ValueError(f"turn {i + 1}'s prompt does not extend the episode's token ids "
                                 "(the environment rewrote earlier messages)")
            env_ids = rec.prompt_ids[len(context):]
            sample.completion_ids += env_ids
            sample.logprobs += [0.0] * len(env_ids)
            sample.versions += [-1] * len(env_ids)
            sample.loss_mask += [0] * len(env_ids)
        sample.completion_ids += rec.completion_ids
        sample.logprobs += rec.logprobs
        sample.versions += rec.versions
        sample.loss_mask += [1] * len(rec.completion_ids)
        sample.finish_reason = rec.finish_reason
    return sample


def _run_coroutine(coro) -> Any:
    """Run `coro` to completion from sync code, also when this thread already runs a loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coro).result()


@register("verifiers")
class VerifiersEnvironment(Environment):
    """A classic `verifiers` environment behind rlcore's Environment interface (module doc)."""

    def __init__(self, load: str = "", env_kwargs: dict[str, Any] | None = None, model_name: str = "rlcore",
                 request_timeout_s: float = 600.0, rollout_timeout_s: float = 1800.0,
                 batch_window_s: float = 0.005, seed: int = 0, **common):
        super().__init__(seed, **common)
        if not load:
            raise ValueError("env.args.load: required for env.name=verifiers ('package.module:function')")
        self.load = load
        self.vf_env = load_verifiers_env(load, dict(env_kwargs or {}))
        self.model_name = model_name
        self.request_timeout_s = float(request_timeout_s)
        self.rollout_timeout_s = float(rollout_timeout_s)
        self.batch_window_s = float(batch_window_s)
        self._server: OpenAIServer | None = None
        self._server_lock = threading.Lock()
        self._datasets: dict[str, Any] = {}

    # ---- tasks ---------------------------------------------------------------------------
    def _dataset(self, split: str):
        """The verifiers env's eval dataset for `eval` (its train dataset when it has none), the
        train dataset for `train` (its eval dataset when it has none)."""
        if split not in self._datasets:
            env = self.vf_env
            has_train = env.dataset is not None or env.dataset_source is not None
            has_eval = env.eval_dataset is not None or env.eval_dataset_source is not None
            use_eval = has_eval if split == "eval" else not has_train
            self._datasets[split] = env.get_eval_dataset() if use_eval else env.get_dataset()
        return self._datasets[split]

    @property
    def eval_size(self) -> int:
        return min(self._eval_size, len(self._dataset("eval")))

    def split_size(self, split: str) -> int | None:
        return len(self._dataset(split))

    def make_task(self, index: int, split: str) -> Task:
        ds = self._dataset(split)
        n = len(ds)
        if n == 0:
            raise ValueError(f"env.args.load: the verifiers environment {self.load!r} has an empty {split} dataset")
        if split == "eval":
            row_index = index % n
        else:  # a seeded permutation per pass over the dataset
            order = list(range(n))
            random.Random(f"{self.seed}:{split}:{index // n}").shuffle(order)
            row_index = order[index % n]
        row = dict(ds[row_index])
        return Task(id=f"verifiers:{split}:{index}", messages=_plain(row.get("prompt")),
                    answer=row.get("answer"), info={"row": row})

    def reward(self, task: Task, completion: str) -> float:
        raise NotImplementedError("verifiers environments are scored by their own rubric")

    # ---- episodes ------------------------------------------------------------------------
    def server(self, engine: RolloutEngine, tokenizer: PreTrainedTokenizerBase) -> OpenAIServer:
        """The actor's endpoint over `engine` (started on first use; restarted for another engine)."""
        from rlcore.serving.openai_server import OpenAIServer, TokenRecorder
        with self._server_lock:
            s = self._server
            if s is None or s.engine is not engine or s.tokenizer is not tokenizer:
                if s is not None:
                    s.stop()
                s = OpenAIServer(engine, tokenizer, model_name=self.model_name,
                                 request_timeout_s=self.request_timeout_s, batch_window_s=self.batch_window_s,
                                 recorder=TokenRecorder())
                self._server = s.start()
            return s

    def close(self) -> None:
        with self._server_lock:
            if self._server is not None:
                self._server.stop()
                self._server = None

    def run_groups(self, tasks: list[Task], group_size: int, engine: RolloutEngine,
                   tokenizer: PreTrainedTokenizerBase, params: SamplingParams) -> list[Group]:
        server = self.server(engine, tokenizer)
        server.defaults = params
        sampling_args = {"max_tokens": params.max_new_tokens, "temperature": params.temperature,
                         "top_p": params.top_p}
        try:
            states = _run_coroutine(asyncio.wait_for(
                self._rollouts(tasks, group_size, server, sampling_args), self.rollout_timeout_s))
            error = None
        except Exception as e:  # noqa: BLE001 (every sample of the request is marked)
            states, error = None, f"verifiers: {type(e).__name__}: {e}"
        groups = []
        for ti, task in enumerate(tasks):
            samples = []
            for j in range(group_size):
                if states is None:
                    sample = self._no_tokens(error)
                else:
                    sample = self._sample(states[ti][j], server)
                samples.append(sample)
            groups.append(Group(task=task, samples=samples))
        return groups

    async def _rollouts(self, tasks: list[Task], group_size: int, server: OpenAIServer,
                        sampling_args: dict[str, Any]) -> list[list[Any]]:
        from openai import AsyncOpenAI

        oai = AsyncOpenAI(base_url=server.base_url, api_key="EMPTY", timeout=self.request_timeout_s, max_retries=0)
        client = empty_answers_client()(oai)
        vf_env = self.vf_env

        async def group(task: Task) -> list[Any]:
            row = task.info["row"]
            inputs = [dict(row) for _ in range(group_size)]
            states = await asyncio.gather(*(vf_env.rollout(inp, client, self.model_name, dict(sampling_args))
                                            for inp in inputs))
            if vf_env.score_rollouts:
                await vf_env.rubric.score_group(states)
            for st in states:
                await vf_env.rubric.cleanup(st)
            return states

        try:
            return list(await asyncio.gather(*(group(t) for t in tasks)))
        finally:
            await oai.close()

    def _no_tokens(self, error: str) -> Sample:
        """A sample without token ids: always failed (nothing to train on), whatever
        `on_reward_error` says."""
        sample = Sample(prompt_ids=[], completion_ids=[], logprobs=[], versions=[], loss_mask=[],
                        finish_reason="abort")
        self.apply_error(sample, error)
        sample.failed = True
        return sample

    def _sample(self, state: Any, server: OpenAIServer) -> Sample:
        steps = state.get("trajectory") or []
        records, missing = [], []
        for step in steps:
            response = step.get("response")
            rid = getattr(response, "id", None) if response is not None else None
            if rid is None and isinstance(response, dict):
                rid = response.get("id")
            rec = server.recorder.pop(rid) if rid else None
            (records.append(rec) if rec is not None else missing.append(rid))
        if missing:
            return self._no_tokens(f"verifiers: no token record for response(s) {missing}")
        if not records:
            err = state.get("error")
            why = f"{type(err).__name__}: {err}" if err is not None else "no error recorded"
            return self._no_tokens(f"verifiers: rollout made no model call ({why})")
        try:
            sample = stitch(records)
        except ValueError as e:
            return self._no_tokens(f"verifiers: {e}")
        err = state.get("error")
        if err is not None:
            self.apply_error(sample, f"verifiers: {type(err).__name__}: {err}")
            return sample
        reward = state.get("reward")
        try:
            reward = float(reward)
        except (TypeError, ValueError):
            self.apply_error(sample, f"reward: not a number ({reward!r})")
            return sample
        if not math.isfinite(reward):
            self.apply_error(sample, f"reward: not finite ({reward})")
            return sample
        sample.reward = reward
        return sample
