"""Run `verifiers` v1 environments (verifiers 0.4.x, `import verifiers.v1 as vf`) on the rollout engine.

`env.name: verifiers`, `env.args.taskset: ID` (the v1 taskset id: an importable package or
module exporting its `vf.Taskset` subclass, and optionally its `vf.Harness` / `vf.Env`, through
`__all__`, exactly as `vf-eval ID` resolves it), `env.args.env_config: {...}` (the rest of the
v1 env config, the `[env]` block of a verifiers TOML: `taskset.*` knobs, `agent.harness.*`,
`agent.runtime.*`, ...; the agent's runtime defaults to the local `subprocess` one here;
`agent.harness.id: null` is verifiers' tool-less `null` harness). An environment with any part
rlcore does not know to be safe (by what it is, never by its own flags: a taskset's own harness or
env class, a harness in a runtime that shares the host, a tool server on this host) could run the
policy's output on this host outside rlcore's sandbox: it is refused
(:mod:`rlcore.envs.verifiers_host`) unless `env.args.allow_host_tools=true`.

Per `run_groups` call, on the rollout actor:

1. an :class:`~rlcore.serving.openai_server.OpenAIServer` (started once, loopback, ephemeral
   port) serves the engine over chat completions; its defaults are this call's SamplingParams;
2. the v1 env plays `group_size` episodes per task (`env.run_episode`, inside `env.serving()`)
   with a `vf.ModelContext` whose client is a `vf.EvalClientConfig` pointed at that server, so
   every model call of the harness goes through verifiers' interception to the server; the
   task's `@vf.reward`s score each trace;
3. each episode's one trainable trace becomes one :class:`Sample` from the token records the
   server keeps for that trace's session (verifiers sends the trace id as `X-Session-ID`): prompt
   ids of the first turn, then each turn's sampled ids (loss_mask 1, the engine's logprobs and
   versions) with the ids the server added between turns (environment tokens: tool results,
   user turns; loss_mask 0, logprob 0.0, version -1). The server's prefix rule makes every later
   turn extend the earlier one token for token; a rollout whose turns do not (the harness
   rewrote its history) cannot be one training sequence and is failed with that error.
   `Sample.prefix_breaks` counts the turns where the chat template's fresh rendering would have
   broken the prefix (the recorded ids were spliced; the driver logs `multiturn_prefix_breaks`).

An empty reply is an ordinary reply: its tokens (at least the end-of-turn token) are trained and
the rubric's reward is kept. An episode that errors (the harness, a timeout, scoring) is handled
per `env.reward.on_error`; one without any recorded model call is always failed (nothing to train).

Limits: one trainable trace per episode (multi-agent envs whose several seats train are refused
per episode); tasks come from the taskset in `load()` order (train: a seeded permutation per
pass; eval: the same tasks in order, `eval_size` of them); `SamplingParams.seed` is not forwarded.
"""

from __future__ import annotations

import asyncio
import importlib
import itertools
import logging
import math
import random
import sys
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING, Any

from rlcore.envs.base import Environment, register
from rlcore.envs.verifiers_host import host_tools, null_harness_id, refusal, taskset_import_error
from rlcore.serving.openai_server import OpenAIServer, TokenRecord, TokenRecorder
from rlcore.serving.tool_parsers import check_tool_parser
from rlcore.types import Group, Sample, Task

if TYPE_CHECKING:  # type names only: validation constructs environments before torch loads
    from transformers import PreTrainedTokenizerBase

    from rlcore.engine.base import RolloutEngine, SamplingParams

log = logging.getLogger("rlcore")

API_KEY_VAR = "RLCORE_VERIFIERS_API_KEY"
"""Env var verifiers reads the endpoint's key from (the loopback server checks none)."""


def _plain(value: Any) -> Any:
    """Plain dicts/lists (OmegaConf containers reach here from `env.args`)."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)) or (isinstance(value, Sequence) and not isinstance(value, str)):
        return [_plain(v) for v in value]
    return value


def v1_env_config(taskset: str, env_config: Mapping[str, Any] | None) -> dict[str, Any]:
    """The v1 env config dict: `env_config` with `taskset.id` set, a local agent runtime unless
    one is given, and `agent.harness.id: None` read as the `null` harness."""
    cfg = null_harness_id(_plain(env_config or {}))
    ts = dict(cfg.get("taskset") or {})
    if taskset:
        ts["id"] = taskset
    if not ts.get("id"):
        raise ValueError("env.args.taskset: required for env.name=verifiers (a verifiers v1 taskset id)")
    cfg["taskset"] = ts
    agent = dict(cfg.get("agent") or {})
    agent.setdefault("runtime", {"type": "subprocess"})
    cfg["agent"] = agent
    return cfg


def load_v1_env(taskset: str, env_config: dict[str, Any] | None = None) -> Any:
    """The `vf.Env` for taskset id `taskset` (+ `env_config`), as verifiers' own loaders build it.

    verifiers resolves an id as a top-level module name; a dotted module path (`my_pkg.my_env`)
    is imported here and registered under its last component, which becomes the id."""
    import verifiers.v1 as vf

    if "." in taskset:
        module = importlib.import_module(taskset)
        alias = taskset.rsplit(".", 1)[-1]
        if sys.modules.setdefault(alias, module) is not module:
            raise ValueError(f"another module is already imported as {alias!r}")
        taskset = alias
    return vf.load_environment(vf.resolve_env_config(v1_env_config(taskset, env_config)))


def task_messages(data: Any) -> list[dict[str, Any]]:
    """The task's opening messages (system prompt, then the prompt) as plain chat dicts."""
    out = [{"role": "system", "content": data.system_prompt}] if getattr(data, "system_prompt", None) else []
    prompt = getattr(data, "prompt", None)
    if isinstance(prompt, str):
        out.append({"role": "user", "content": prompt})
    elif prompt:
        from verifiers.v1.dialects.chat import message_to_wire

        out += [m if isinstance(m, dict) else message_to_wire(m) for m in prompt]
    return out


def stitch(records: list[TokenRecord]) -> Sample:
    """One sample from a rollout's per-turn token records (raises ValueError when a turn's
    prompt does not extend the previous turn's ids)."""
    first = records[0]
    sample = Sample(prompt_ids=list(first.prompt_ids), completion_ids=[], logprobs=[], versions=[], loss_mask=[])
    for i, rec in enumerate(records):
        context = sample.prompt_ids + sample.completion_ids
        if i:
            if rec.prompt_ids[: len(context)] != context:
                raise ValueError(
                    f"turn {i + 1}'s prompt does not extend the episode's token ids "
                    "(the harness rewrote earlier messages)"
                )
            env_ids = rec.prompt_ids[len(context) :]
            sample.completion_ids += env_ids
            sample.logprobs += [0.0] * len(env_ids)
            sample.versions += [-1] * len(env_ids)
            sample.loss_mask += [0] * len(env_ids)
        sample.completion_ids += rec.completion_ids
        sample.logprobs += rec.logprobs
        sample.versions += rec.versions
        sample.loss_mask += [1] * len(rec.completion_ids)
        sample.finish_reason = rec.finish_reason
        sample.prefix_breaks += int(rec.prefix_break)
    return sample


class _LoopThread:
    """One event loop on a daemon thread for all of an environment's episodes: verifiers keeps
    asyncio locks and pools bound to the loop that first used them, so every call must run on
    the same loop."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="verifiers-loop", daemon=True)
        self._thread.start()

    def run(self, coro, timeout_s: float) -> Any:
        """`coro`'s result, or TimeoutError after `timeout_s` (the coroutine is cancelled)."""
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout_s)
        except FutureTimeout:
            future.cancel()
            raise TimeoutError(f"rollouts exceeded rollout_timeout_s={timeout_s}") from None

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=30)


@register("verifiers")
class VerifiersEnvironment(Environment):
    """A verifiers v1 environment behind rlcore's Environment interface (module doc)."""

    reward_range = (-math.inf, math.inf)
    """A rubric's weighted sum has the scale its taskset gives it: declare it with
    `env.args.reward_range: [lo, hi]` to have every reward checked against it."""

    def __init__(
        self,
        taskset: str = "",
        env_config: dict[str, Any] | None = None,
        model_name: str = "rlcore",
        tool_parser: str = "hermes",
        request_timeout_s: float = 600.0,
        rollout_timeout_s: float = 1800.0,
        batch_window_s: float = 0.005,
        max_tasks: int = 100_000,
        allow_host_tools: bool = False,
        seed: int = 0,
        **common,
    ):
        super().__init__(seed, **common)
        try:
            check_tool_parser(tool_parser)
        except ValueError as e:
            raise ValueError(f"env.args.{e}") from None
        try:
            self.vf_env = load_v1_env(taskset, env_config)
        except (ImportError, TypeError, ValueError) as e:  # a missing taskset, a bad config key
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            if isinstance(e, ImportError):  # verifiers says "not found" for any ImportError inside it
                first = taskset_import_error(taskset) or first
            raise ValueError(f"env.args.taskset: cannot load verifiers v1 env {taskset!r}: {first}") from e
        found = host_tools(self.vf_env)
        if found and allow_host_tools is not True:
            raise ValueError(refusal(found))
        if found:
            log.warning(
                "verifiers: parts rlcore does not know to be safe run on this host, outside rlcore's sandbox "
                "(env.args.allow_host_tools=true): "
                "%s",
                "; ".join(found),
            )
        self.model_name = model_name
        self.tool_parser = tool_parser
        self.request_timeout_s = float(request_timeout_s)
        self.rollout_timeout_s = float(rollout_timeout_s)
        self.batch_window_s = float(batch_window_s)
        self._tasks = list(itertools.islice(iter(self.vf_env.taskset), int(max_tasks)))
        if not self._tasks:
            raise ValueError(f"env.args.taskset: taskset {taskset!r} yielded no tasks")
        self._server: OpenAIServer | None = None
        self._server_lock = threading.Lock()
        self._loop: _LoopThread | None = None

    # ---- tasks ---------------------------------------------------------------------------
    @property
    def eval_size(self) -> int:
        return min(self._eval_size, len(self._tasks))

    def make_task(self, index: int, split: str) -> Task:
        n = len(self._tasks)
        if split == "eval":
            row = index % n
        else:  # a seeded permutation per pass over the taskset
            order = list(range(n))
            random.Random(f"{self.seed}:{split}:{index // n}").shuffle(order)
            row = order[index % n]
        data = self._tasks[row].data
        answer = getattr(data, "answer", None)
        return Task(
            id=f"verifiers:{split}:{index}",
            messages=task_messages(data),
            answer=answer if isinstance(answer, str) else None,
            info={"vf_index": row},
        )

    def demonstration_messages(self, task: Task) -> list[dict[str, Any]] | None:
        """The task's messages then the task data's `demonstration` (the messages after the
        prompt: tool calls, tool results, the final reply) when it has one, else its string
        `answer` as one assistant reply."""
        demo = getattr(self._tasks[task.info["vf_index"]].data, "demonstration", None)
        return [*task.messages, *(dict(m) for m in demo)] if demo else super().demonstration_messages(task)

    def reward(self, task: Task, completion: str) -> float:
        raise NotImplementedError("verifiers environments are scored by their tasks' @vf.reward functions")

    # ---- episodes ------------------------------------------------------------------------
    def server(self, engine: RolloutEngine, tokenizer: PreTrainedTokenizerBase) -> OpenAIServer:
        """The actor's endpoint over `engine` (started on first use; restarted for another engine)."""
        with self._server_lock:
            s = self._server
            if s is None or s.engine is not engine or s.tokenizer is not tokenizer:
                if s is not None:
                    s.stop()
                s = OpenAIServer(
                    engine,
                    tokenizer,
                    model_name=self.model_name,
                    request_timeout_s=self.request_timeout_s,
                    batch_window_s=self.batch_window_s,
                    recorder=TokenRecorder(),
                    tool_parser=self.tool_parser,
                )
                self._server = s.start()
            return s

    def close(self) -> None:
        with self._server_lock:
            if self._server is not None:
                self._server.stop()
                self._server = None
            if self._loop is not None:
                self._loop.stop()
                self._loop = None

    def run_groups(
        self,
        tasks: list[Task],
        group_size: int,
        engine: RolloutEngine,
        tokenizer: PreTrainedTokenizerBase,
        params: SamplingParams,
    ) -> list[Group]:
        server = self.server(engine, tokenizer)
        server.defaults = params
        with self._server_lock:
            if self._loop is None:
                self._loop = _LoopThread()
            loop = self._loop
        try:
            episodes = loop.run(self._episodes(tasks, group_size, server, params), self.rollout_timeout_s)
            error = None
        except Exception as e:  # noqa: BLE001 (every sample of the request is marked)
            episodes, error = None, f"verifiers: {type(e).__name__}: {e}"
        groups = []
        for ti, task in enumerate(tasks):
            samples = [
                self._no_tokens(error) if episodes is None else self._sample(episodes[ti][j], server)
                for j in range(group_size)
            ]
            groups.append(Group(task=task, samples=samples))
        errors = [s for g in groups for s in g.samples if s.error]
        if errors:  # the driver counts them; the reason is only here
            log.warning(
                "verifiers: %d of %d samples errored (%d failed); first: %s",
                len(errors),
                len(tasks) * group_size,
                sum(s.failed for s in errors),
                errors[0].error,
            )
        return groups

    async def _episodes(
        self, tasks: list[Task], group_size: int, server: OpenAIServer, params: SamplingParams
    ) -> list[list[Any]]:
        import verifiers.v1 as vf

        ctx = vf.ModelContext(
            model=self.model_name,
            client=vf.EvalClientConfig(base_url=server.base_url, api_key_var=API_KEY_VAR),
            sampling=vf.SamplingConfig(
                max_tokens=params.max_new_tokens, temperature=params.temperature, top_p=params.top_p
            ),
        )
        env = self.vf_env
        async with env.serving():
            flat = await asyncio.gather(
                *(env.run_episode(self._tasks[t.info["vf_index"]], ctx) for t in tasks for _ in range(group_size))
            )
        return [flat[i * group_size : (i + 1) * group_size] for i in range(len(tasks))]

    def _no_tokens(self, error: str) -> Sample:
        """A sample without token ids: always failed (nothing to train on), whatever
        `env.reward.on_error` says."""
        sample = Sample(prompt_ids=[], completion_ids=[], logprobs=[], versions=[], loss_mask=[], finish_reason="abort")
        self.apply_error(sample, error)
        sample.failed = True
        return sample

    def _sample(self, episode: Any, server: OpenAIServer) -> Sample:
        per_trace = [(t, server.recorder.pop_session(t.id)) for t in episode.traces]
        trainable = [(t, recs) for t, recs in per_trace if t.agent.trainable]
        if len(trainable) != 1:
            why = "; ".join(f"{e.type}: {e.message}" for e in episode.errors) or "no error recorded"
            return self._no_tokens(
                f"verifiers: episode has {len(trainable)} trainable traces, one is supported ({why})"
            )
        trace, records = trainable[0]
        errors = [*episode.errors, *trace.errors]
        why = "; ".join(f"{e.type}: {e.message}" for e in errors)
        if not records:
            return self._no_tokens(f"verifiers: rollout made no model call ({why or 'no error recorded'})")
        try:
            sample = stitch(records)
        except ValueError as e:
            return self._no_tokens(f"verifiers: {e}")
        if errors or not episode.ok:
            self.apply_error(sample, f"verifiers: {why or 'episode not ok'}")
            return sample
        if any(r is None for r in trace.rewards.values()):
            self.apply_error(sample, "reward: scoring did not run")
            return sample
        reward = trace.reward
        if not math.isfinite(reward):
            self.apply_error(sample, f"reward: not finite ({reward})")
            return sample
        self.set_reward(sample, float(reward))
        return sample
