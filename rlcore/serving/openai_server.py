"""A small OpenAI-compatible chat-completions server in front of a :class:`RolloutEngine`.

Over 400 lines: the endpoint, its token bookkeeping and its tool-call parsing answer one request together.

Environments written for an OpenAI client (the `verifiers` package, agent harnesses) call it;
the framework reads back, for every response, the exact token ids the engine saw and sampled,
with their logprobs and policy versions, so training samples are built without re-tokenizing.

- Loopback only (127.0.0.1), ephemeral port, served by aiohttp on a background thread with its
  own event loop. `POST /v1/chat/completions` and `GET /v1/models`.
- As OpenAI's API: `n` choices per request (independent samples of one prompt), `stop` strings
  (the text ends before the earliest one, finish reason `stop`; applied to the sampled ids, see
  :func:`rlcore.serving.replies.truncate_at_stop`), `logprobs` (the sampled tokens' logprobs;
  `top_logprobs` alternatives are refused: the engines return none), `tools` (rendered through
  the chat template) with the reply's tool calls parsed into `tool_calls` by the parser named
  `tool_parser` (:mod:`rlcore.serving.tool_parsers`: vLLM's own registry where vLLM is installed,
  the built-in `hermes` otherwise), finish reason `tool_calls` then; `tool_choice: none` turns
  parsing off for the request. `stream: true` answers the same response as server-sent
  `chat.completion.chunk` events once generation is done (`stream_options.include_usage` adds
  the usage chunk).
- Requests arriving within `batch_window_s` of each other with the same sampling settings are
  sent to the engine as one batch; engine calls are serialized (one at a time). Every request has
  a deadline (`request_timeout_s`, answered 504).
- Prompt rendering and the multi-turn prefix rule: a request's messages are matched against the
  conversations already answered. If its messages start with an earlier request's messages
  followed by that request's assistant reply (same role, content and tool calls), the prompt ids
  are that episode's exact ids (`prompt_ids + completion_ids` of the earlier response) followed
  by the template delta of the new messages (:class:`rlcore.models.render.TurnRenderer`: the
  end-of-turn marker if the policy did not emit it, the new messages (tool results included),
  the next assistant header). The longest such match wins. Otherwise the messages are rendered
  from scratch with the chat template. So a later turn's prompt ids always extend the earlier
  turn's ids token for token, and no sampled token is ever re-tokenized.
- Prefix breaks: on every continued turn the server also renders the whole request from scratch;
  where that rendering does not begin with the recorded ids (a template that re-renders earlier
  turns differently, such as Qwen3's dropping `<think>` from earlier assistant turns, or text
  that tokenizes differently than it was sampled) the turn is marked `prefix_break` on its
  record. The recorded ids are spliced either way; the count is reported per sample.
- :class:`TokenRecorder` keeps a :class:`TokenRecord` per choice until the framework pops it
  (bounded: the oldest are evicted past `max_records`), and groups them by the `X-Session-ID`
  header (one verifiers rollout).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Self

from aiohttp import web

from rlcore.engine.base import Generation, RolloutEngine, SamplingParams
from rlcore.models.render import TurnRenderer
from rlcore.serving.records import TokenRecord, TokenRecorder, normalize_messages
from rlcore.serving.replies import logprobs_content, truncate_at_stop
from rlcore.serving.tool_parsers import make_tool_parser, vllm_available

if TYPE_CHECKING:  # type names only: validation imports this before torch loads
    from transformers import PreTrainedTokenizerBase

__all__ = ["OpenAIServer", "TokenRecord", "TokenRecorder", "normalize_messages"]

SESSION_HEADER = "X-Session-ID"
"""Per-rollout header verifiers' clients send (the trace id); groups a rollout's responses."""


@dataclass
class _Pending:
    prompt_ids: list[int]
    params: SamplingParams
    future: asyncio.Future


class OpenAIServer:
    """Serve `engine` over the OpenAI chat-completions protocol on 127.0.0.1 (see module doc).

    `defaults` are the sampling settings a request does not override (`max_tokens` /
    `max_completion_tokens`, `temperature`, `top_p`, `seed`); `stop_token_ids` always come from
    them. `tool_parser` names the tool-call parser (`none` = off). Use as a context manager, or
    `start()` / `stop()`.
    """

    def __init__(
        self,
        engine: RolloutEngine,
        tokenizer: PreTrainedTokenizerBase,
        defaults: SamplingParams | None = None,
        model_name: str = "rlcore",
        request_timeout_s: float = 600.0,
        batch_window_s: float = 0.005,
        max_batch: int = 256,
        recorder: TokenRecorder | None = None,
        tool_parser: str = "hermes",
    ):
        self.engine = engine
        self.tokenizer = tokenizer
        self.defaults = defaults or SamplingParams()
        self.model_name = model_name
        self.request_timeout_s = float(request_timeout_s)
        self.batch_window_s = float(batch_window_s)
        self.max_batch = int(max_batch)
        self.recorder = recorder or TokenRecorder()
        self._renderer = TurnRenderer(tokenizer) if tokenizer.eos_token else None
        # vLLM's parsers are text-level: used wherever vLLM is installed, whatever the engine
        self._parse_tools = make_tool_parser(tool_parser, tokenizer, vllm_available())
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
    def render(self, messages: list[dict[str, Any]], tools: list | None = None) -> list[int]:
        """`messages` rendered from scratch with the chat template (and `tools`), ending with
        the assistant header."""
        text = self.tokenizer.apply_chat_template(
            messages, tools=tools or None, add_generation_prompt=True, tokenize=False
        )
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def prompt_ids(self, messages: list[dict[str, Any]], tools: list | None = None) -> tuple[list[int], bool]:
        """(exact prompt ids for `messages` by the prefix rule, whether that turn is a prefix
        break: a fresh rendering would not have continued the recorded ids) (module doc)."""
        match = self.recorder.longest_episode(messages) if self._renderer is not None else None
        if match is None:
            return self.render(messages, tools), False
        k, rec = match
        context = rec.prompt_ids + rec.completion_ids
        fresh = self.render(messages, tools)
        return context + self._renderer.continuation(rec.completion_ids, messages[k:]), fresh[: len(context)] != context

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
                    self._executor, self.engine.generate, [p.prompt_ids for p in group], group[0].params
                )
                for p, g in zip(group, gens):
                    if not p.future.done():
                        p.future.set_result(g)
            except Exception as e:  # noqa: BLE001 (answered as a 500 to each request)
                for p in group:
                    if not p.future.done():
                        p.future.set_exception(e)

    # ---- handlers ------------------------------------------------------------------------
    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0, "owned_by": "rlcore"}]}
        )

    @staticmethod
    def _error(status: int, message: str, kind: str = "invalid_request_error") -> web.Response:
        return web.json_response({"error": {"message": message, "type": kind, "code": status}}, status=status)

    def _params(self, body: dict[str, Any]) -> SamplingParams:
        if body.get("top_logprobs"):
            raise ValueError("top_logprobs: alternatives are not available (logprobs of the sampled tokens only)")
        n = body.get("n", 1)
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"n: must be a positive integer, got {n!r}")
        stop = body.get("stop")
        if stop is not None and not (
            isinstance(stop, str) or (isinstance(stop, list) and all(isinstance(s, str) for s in stop))
        ):
            raise ValueError("stop: a string or a list of strings")
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

    def _choice(
        self, index: int, gen: Generation, body: dict[str, Any], tools: list | None, stops: list[str]
    ) -> tuple[dict[str, Any], Generation, str, list[dict[str, Any]]]:
        """(OpenAI choice, kept generation, content, tool calls) for one sampled completion."""
        gen, text = truncate_at_stop(self.tokenizer, gen, stops)
        content, calls = text, []
        if tools and self._parse_tools is not None and body.get("tool_choice") != "none":
            parsed = self._parse_tools(text, tools)
            content, calls = parsed.content, parsed.tool_calls
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
            message["content"] = content or None
        # an aborted request reads as truncated to the client; the record keeps `abort`
        finish = "tool_calls" if calls else ("stop" if gen.finish_reason == "stop" else "length")
        choice = {"index": index, "message": message, "finish_reason": finish, "logprobs": None}
        if body.get("logprobs"):
            choice["logprobs"] = {"content": logprobs_content(self.tokenizer, gen)}
        return choice, gen, content, calls

    async def _chat(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
            messages = normalize_messages(body.get("messages"))
            params = self._params(body)
            tools = body.get("tools") or None
            prompt_ids, prefix_break = self.prompt_ids(messages, tools)
        except (ValueError, TypeError, json.JSONDecodeError) as e:
            return self._error(400, str(e))
        n = int(body.get("n", 1))
        loop = asyncio.get_running_loop()
        futures = []
        for i in range(n):  # n independent samples (a fixed seed is offset per choice)
            p = params if params.seed is None or i == 0 else dataclasses.replace(params, seed=params.seed + i)
            futures.append(loop.create_future())
            await self._queue.put(_Pending(prompt_ids, p, futures[-1]))
        try:
            gens = await asyncio.wait_for(asyncio.gather(*futures), self.request_timeout_s)
        except TimeoutError:
            return self._error(504, f"generation exceeded request_timeout_s={self.request_timeout_s}", "timeout")
        except Exception as e:  # noqa: BLE001
            return self._error(500, f"engine: {type(e).__name__}: {e}", "server_error")
        stop = body.get("stop")
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        response_id = f"chatcmpl-{uuid.uuid4().hex}"
        session = request.headers.get(SESSION_HEADER) if n == 1 else None
        choices, completion_tokens = [], 0
        for i, gen in enumerate(gens):
            choice, kept, content, calls = self._choice(i, gen, body, tools, stops)
            choices.append(choice)
            completion_tokens += len(kept.token_ids)
            self.recorder.add(
                response_id if i == 0 else f"{response_id}-{i}",
                messages,
                TokenRecord(
                    prompt_ids=list(prompt_ids),
                    completion_ids=list(kept.token_ids),
                    logprobs=list(kept.logprobs),
                    versions=list(kept.versions),
                    finish_reason=kept.finish_reason,
                    text=content,
                    tool_calls=calls or None,
                    prefix_break=prefix_break,
                ),
                session=session,
            )
        payload = {
            "id": response_id,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model") or self.model_name,
            "choices": choices,
            "usage": {
                "prompt_tokens": len(prompt_ids),
                "completion_tokens": completion_tokens,
                "total_tokens": len(prompt_ids) + completion_tokens,
            },
        }
        if body.get("stream"):
            return await self._stream(request, payload, bool((body.get("stream_options") or {}).get("include_usage")))
        return web.json_response(payload)

    @staticmethod
    async def _stream(request: web.Request, payload: dict[str, Any], include_usage: bool) -> web.StreamResponse:
        """The finished response as OpenAI server-sent `chat.completion.chunk` events (per
        choice: the role and content, the tool calls, the finish reason; then the usage when
        asked; then `[DONE]`). Generation is not incremental, so the events come at once."""
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        head = {k: payload[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}

        async def send(obj: dict[str, Any] | str) -> None:
            await resp.write(f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode())

        for c in payload["choices"]:
            msg = c["message"]
            await send(
                {
                    **head,
                    "choices": [
                        {
                            "index": c["index"],
                            "logprobs": c["logprobs"],
                            "finish_reason": None,
                            "delta": {"role": "assistant", "content": msg["content"] or ""},
                        }
                    ],
                }
            )
            if msg.get("tool_calls"):
                calls = [{"index": j, **tc} for j, tc in enumerate(msg["tool_calls"])]
                await send(
                    {
                        **head,
                        "choices": [
                            {
                                "index": c["index"],
                                "delta": {"tool_calls": calls},
                                "logprobs": None,
                                "finish_reason": None,
                            }
                        ],
                    }
                )
            await send(
                {
                    **head,
                    "choices": [
                        {"index": c["index"], "delta": {}, "logprobs": None, "finish_reason": c["finish_reason"]}
                    ],
                }
            )
        if include_usage:
            await send({**head, "choices": [], "usage": payload["usage"]})
        await send("[DONE]")
        await resp.write_eof()
        return resp
