"""A small OpenAI-compatible chat-completions server in front of a :class:`RolloutEngine`.

Environments written for an OpenAI client (the `verifiers` package, agent harnesses) call it;
the framework reads back, for every response, the exact token ids the engine saw and sampled,
with their logprobs and policy versions, so training samples are built without re-tokenizing.

- Loopback only (127.0.0.1), ephemeral port, served by aiohttp on a background thread with its
  own event loop. `POST /v1/chat/completions` (n=1, no streaming) and `GET /v1/models`.
- Requests arriving within `batch_window_s` of each other with the same sampling settings are
  sent to the engine as one batch; engine calls are serialized (one at a time). Every request has
  a deadline (`request_timeout_s`, answered 504).
- Prompt rendering and the multi-turn prefix rule: a request's messages are matched against the
  conversations already answered. If its messages start with an earlier request's messages
  followed by that request's assistant reply (same role and text), the prompt ids are that
  episode's exact ids (`prompt_ids + completion_ids` of the earlier response) followed by the
  template delta of the new messages (:class:`rlcore.envs.render.TurnRenderer`: the end-of-turn
  marker if the policy did not emit it, the new messages, the next assistant header). The
  longest such match wins. Otherwise the messages are rendered from scratch with the chat
  template (:func:`rlcore.envs.render.render_prompt`). So a later turn's prompt ids always extend
  the earlier turn's ids token for token, and no sampled token is ever re-tokenized.
- :class:`TokenRecorder` keeps a :class:`TokenRecord` per response id until the framework pops
  it (bounded: the oldest are evicted past `max_records`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time
import uuid
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Self

from aiohttp import web
from transformers import PreTrainedTokenizerBase

from rlcore.engine.base import RolloutEngine, SamplingParams
from rlcore.envs.render import TurnRenderer, render_prompt


@dataclass
class TokenRecord:
    """What the engine saw and produced for one chat-completions response."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str  # the engine's: stop | length | abort
    text: str


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: only text is supported
        parts = []
        for p in content:
            if isinstance(p, dict) and p.get("type") in ("text", "input_text", "output_text"):
                parts.append(str(p.get("text", "")))
            else:
                raise ValueError(f"unsupported message content part {p!r} (text only)")
        return "".join(parts)
    raise ValueError(f"unsupported message content {type(content).__name__}")


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """Plain `{role, content}` dicts (text content; `name`/`tool_call_id` kept)."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages: a non-empty list is required")
    out = []
    for m in messages:
        if not isinstance(m, dict) or "role" not in m:
            raise ValueError(f"messages: each message needs a role, got {m!r}")
        msg = {"role": str(m["role"]), "content": _content_text(m.get("content"))}
        for k in ("name", "tool_call_id"):
            if m.get(k) is not None:
                msg[k] = m[k]
        out.append(msg)
    return out


def _key(messages: list[dict[str, Any]]) -> str:
    return json.dumps([[m["role"], m["content"], m.get("name"), m.get("tool_call_id")] for m in messages])


class TokenRecorder:
    """Token records by response id, and the episode index used by the prefix rule."""

    def __init__(self, max_records: int = 100_000):
        self.max_records = max_records
        self._lock = threading.Lock()
        self._records: OrderedDict[str, TokenRecord] = OrderedDict()
        self._episodes: dict[str, str] = {}  # key(messages + reply) -> response id
        self._episode_of: dict[str, str] = {}

    def add(self, response_id: str, messages: list[dict[str, Any]], record: TokenRecord) -> None:
        key = _key([*messages, {"role": "assistant", "content": record.text}])
        with self._lock:
            self._records[response_id] = record
            self._episodes[key] = response_id
            self._episode_of[response_id] = key
            while len(self._records) > self.max_records:
                old, _ = self._records.popitem(last=False)
                self._forget(old)

    def _forget(self, response_id: str) -> None:
        key = self._episode_of.pop(response_id, None)
        if key is not None and self._episodes.get(key) == response_id:
            del self._episodes[key]

    def get(self, response_id: str) -> TokenRecord | None:
        with self._lock:
            return self._records.get(response_id)

    def pop(self, response_id: str) -> TokenRecord | None:
        with self._lock:
            self._forget(response_id)
            return self._records.pop(response_id, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._records)

    def longest_episode(self, messages: list[dict[str, Any]]) -> tuple[int, TokenRecord] | None:
        """(k, record) for the longest k < len(messages) where messages[:k] is an answered
        conversation ending with its recorded assistant reply."""
        with self._lock:
            for k in range(len(messages) - 1, 0, -1):
                if messages[k - 1]["role"] != "assistant":
                    continue
                rid = self._episodes.get(_key(messages[:k]))
                if rid is not None and rid in self._records:
                    return k, self._records[rid]
        return None


@dataclass
class _Pending:
    prompt_ids: list[int]
    params: SamplingParams
    future: asyncio.Future


class OpenAIServer:
    """Serve `engine` over the OpenAI chat-completions protocol on 127.0.0.1 (see module doc).

    `defaults` are the sampling settings a request does not override (`max_tokens` /
    `max_completion_tokens`, `temperature`, `top_p`, `seed`); `stop_token_ids` always come from
    them. Use as a context manager, or `start()` / `stop()`.
    """

    def __init__(self, engine: RolloutEngine, tokenizer: PreTrainedTokenizerBase,
                 defaults: SamplingParams | None = None, model_name: str = "rlcore",
                 request_timeout_s: float = 600.0, batch_window_s: float = 0.005,
                 max_batch: int = 256, recorder: TokenRecorder | None = None):
        self.engine = engine
        self.tokenizer = tokenizer
        self.defaults = defaults or SamplingParams()
        self.model_name = model_name
        self.request_timeout_s = float(request_timeout_s)
        self.batch_window_s = float(batch_window_s)
        self.max_batch = int(max_batch)
        self.recorder = recorder or TokenRecorder()
        self._renderer = TurnRenderer(tokenizer) if tokenizer.eos_token else None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None
        self._queue: asyncio.Queue | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="openai-server-engine")
        self.port: int | None = None

    # ---- lifecycle -----------------------------------------------------------------------
    @property
    def base_url(self) -> str:
        if self.port is None:
            raise RuntimeError("server not started")
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self, timeout_s: float = 30.0) -> OpenAIServer:
        if self._thread is not None:
            return self
        ready = threading.Event()
        errors: list[BaseException] = []

        def main() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            asyncio.set_event_loop(loop)
            try:
                loop.run_until_complete(self._serve())
            except BaseException as e:  # noqa: BLE001 (reported to start())
                errors.append(e)
                ready.set()
                return
            ready.set()
            loop.run_forever()
            loop.run_until_complete(self._shutdown())
            loop.close()

        self._thread = threading.Thread(target=main, name="openai-server", daemon=True)
        self._thread.start()
        if not ready.wait(timeout_s) or errors:
            raise RuntimeError(f"OpenAI server did not start: {errors[0] if errors else 'timeout'}")
        return self

    def stop(self) -> None:
        if self._thread is None or self._loop is None:
            return
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
        self._thread = None
        self._executor.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    async def _serve(self) -> None:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = self._runner.addresses[0][1]
        self._queue = asyncio.Queue()
        self._batcher = asyncio.get_running_loop().create_task(self._batch_loop())

    async def _shutdown(self) -> None:
        self._batcher.cancel()
        if self._runner is not None:
            await self._runner.cleanup()

    # ---- prompt ids ----------------------------------------------------------------------
    def prompt_ids(self, messages: list[dict[str, Any]], tools: list | None = None) -> list[int]:
        """Exact prompt ids for `messages` by the prefix rule (module doc)."""
        match = self.recorder.longest_episode(messages) if self._renderer is not None and not tools else None
        if match is not None:
            k, rec = match
            rest = messages[k:]
            return rec.prompt_ids + rec.completion_ids + self._renderer.continuation(rec.completion_ids, rest)
        if tools:
            text = self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
            return self.tokenizer(text, add_special_tokens=False).input_ids
        return render_prompt(self.tokenizer, messages)

    # ---- engine batching -----------------------------------------------------------------
    async def _batch_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            first: _Pending = await self._queue.get()
            batch = [first]
            deadline = loop.time() + self.batch_window_s
            while len(batch) < self.max_batch:
                timeout = deadline - loop.time()
                if timeout <= 0:
                    break
                try:
                    batch.append(await asyncio.wait_for(self._queue.get(), timeout))
                except TimeoutError:
                    break
            batch = [p for p in batch if not p.future.done()]  # timed-out requests
            try:
                await self._dispatch(batch)
            except Exception as e:  # noqa: BLE001 (never let the loop die: fail the batch)
                for p in batch:
                    if not p.future.done():
                        p.future.set_exception(e)

    async def _dispatch(self, batch: list[_Pending]) -> None:
        loop = asyncio.get_running_loop()
        groups: dict[str, list[_Pending]] = {}
        for p in batch:  # one engine call per distinct sampling setting
            groups.setdefault(repr(p.params), []).append(p)
        for group in groups.values():
            try:
                gens = await loop.run_in_executor(
                    self._executor, self.engine.generate, [p.prompt_ids for p in group], group[0].params)
                for p, g in zip(group, gens):
                    if not p.future.done():
                        p.future.set_result(g)
            except Exception as e:  # noqa: BLE001 (answered as a 500 to each request)
                for p in group:
                    if not p.future.done():
                        p.future.set_exception(e)

    # ---- handlers ------------------------------------------------------------------------
    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": 0, "owned_by": "rlcore"}]})

    @staticmethod
    def _error(status: int, message: str, kind: str = "invalid_request_error") -> web.Response:
        return web.json_response({"error": {"message": message, "type": kind, "code": status}}, status=status)

    def _params(self, body: dict[str, Any]) -> SamplingParams:
        if body.get("n", 1) != 1:
            raise ValueError("n: only n=1 is supported")
        if body.get("stream"):
            raise ValueError("stream: streaming is not supported")
        if body.get("stop"):
            raise ValueError("stop: stop strings are not supported (the engine stops on token ids)")
        p = self.defaults
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        return dataclasses.replace(
            p,
            max_new_tokens=int(max_tokens) if max_tokens is not None else p.max_new_tokens,
            temperature=float(body["temperature"]) if body.get("temperature") is not None else p.temperature,
            top_p=float(body["top_p"]) if body.get("top_p") is not None else p.top_p,
            seed=int(body["seed"]) if body.get("seed") is not None else p.seed,
            stop_token_ids=list(p.stop_token_ids),
        )

    async def _chat(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
            messages = normalize_messages(body.get("messages"))
            params = self._params(body)
            tools = body.get("tools") or None
            prompt_ids = self.prompt_ids(messages, tools)
        except (ValueError, TypeError, json.JSONDecodeError) as e:
            return self._error(400, str(e))
        future = asyncio.get_running_loop().create_future()
        await self._queue.put(_Pending(prompt_ids, params, future))
        try:
            gen = await asyncio.wait_for(future, self.request_timeout_s)
        except TimeoutError:
            return self._error(504, f"generation exceeded request_timeout_s={self.request_timeout_s}", "timeout")
        except Exception as e:  # noqa: BLE001
            return self._error(500, f"engine: {type(e).__name__}: {e}", "server_error")
        text = self.tokenizer.decode(gen.token_ids, skip_special_tokens=True)
        response_id = f"chatcmpl-{uuid.uuid4().hex}"
        self.recorder.add(response_id, messages, TokenRecord(
            prompt_ids=list(prompt_ids), completion_ids=list(gen.token_ids), logprobs=list(gen.logprobs),
            versions=list(gen.versions), finish_reason=gen.finish_reason, text=text))
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            # an aborted request reads as truncated to the client; the record keeps `abort`
            "finish_reason": "stop" if gen.finish_reason == "stop" else "length",
            "logprobs": None,
        }
        if body.get("logprobs"):
            choice["logprobs"] = {"content": [
                {"token": self.tokenizer.decode([t]), "logprob": lp, "bytes": None, "top_logprobs": []}
                for t, lp in zip(gen.token_ids, gen.logprobs)]}
        return web.json_response({
            "id": response_id, "object": "chat.completion", "created": int(time.time()),
            "model": body.get("model") or self.model_name, "choices": [choice],
            "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(gen.token_ids),
                      "total_tokens": len(prompt_ids) + len(gen.token_ids)},
        })
