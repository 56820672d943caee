"""What the OpenAI-compatible server remembers: per-response token records, the conversations
they answered (for the multi-turn prefix rule) and the sessions (agent rollouts) they belong to.

Messages are normalized once (:func:`normalize_messages`): text content, `name`,
`tool_call_id`, and assistant `tool_calls` with their arguments decoded from JSON, the form chat
templates render. Two messages are the same turn when role, content, name, tool_call_id and the
tool calls' names and arguments (as JSON values, so key order and spacing do not matter) agree;
tool-call ids are not compared (harnesses may re-label them).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass
class TokenRecord:
    """What the engine saw and produced for one chat-completions choice."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str  # the engine's: stop | length | abort
    text: str
    """The reply's content as answered (after stop-string truncation and tool-call extraction)."""
    tool_calls: list[dict[str, Any]] | None = None
    """The reply's parsed tool calls (OpenAI form), if any."""
    prefix_break: bool = False
    """True when this turn continued a recorded episode whose ids a fresh chat-template rendering
    of the request would not have continued (the recorded ids were spliced in instead)."""


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


def _json_value(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return arguments


def _tool_calls(calls: Any) -> list[dict[str, Any]]:
    if not isinstance(calls, list):
        raise ValueError(f"messages: tool_calls must be a list, got {type(calls).__name__}")
    out = []
    for c in calls:
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ValueError(f"messages: each tool call needs function.name, got {c!r}")
        out.append(
            {
                "id": c.get("id"),
                "type": "function",
                "function": {"name": fn["name"], "arguments": _json_value(fn.get("arguments", {}))},
            }
        )
    return out


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """Plain `{role, content}` dicts (text content; `name`, `tool_call_id` and assistant
    `tool_calls` kept, tool-call arguments as JSON values)."""
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
        if m.get("tool_calls"):
            msg["tool_calls"] = _tool_calls(m["tool_calls"])
        out.append(msg)
    return out


def _key(messages: list[dict[str, Any]]) -> str:
    return json.dumps(
        [
            [
                m["role"],
                m["content"],
                m.get("name"),
                m.get("tool_call_id"),
                [[c["function"]["name"], c["function"]["arguments"]] for c in m.get("tool_calls") or []],
            ]
            for m in messages
        ],
        sort_keys=True,
    )


class TokenRecorder:
    """Token records by response id, the episode index used by the prefix rule, and the
    response ids of each session (the `X-Session-ID` header verifiers sends: one per rollout)."""

    def __init__(self, max_records: int = 100_000):
        self.max_records = max_records
        self._lock = threading.Lock()
        self._records: OrderedDict[str, TokenRecord] = OrderedDict()
        self._episodes: dict[str, str] = {}  # key(messages + reply) -> response id
        self._episode_of: dict[str, str] = {}
        self._sessions: dict[str, list[str]] = {}
        self._session_of: dict[str, str] = {}

    def add(
        self, response_id: str, messages: list[dict[str, Any]], record: TokenRecord, session: str | None = None
    ) -> None:
        reply = {"role": "assistant", "content": record.text}
        if record.tool_calls:
            reply["tool_calls"] = _tool_calls(record.tool_calls)
        key = _key([*messages, reply])
        with self._lock:
            self._records[response_id] = record
            self._episodes[key] = response_id
            self._episode_of[response_id] = key
            if session:
                self._sessions.setdefault(session, []).append(response_id)
                self._session_of[response_id] = session
            while len(self._records) > self.max_records:
                old, _ = self._records.popitem(last=False)
                self._forget(old)

    def _forget(self, response_id: str) -> None:
        key = self._episode_of.pop(response_id, None)
        if key is not None and self._episodes.get(key) == response_id:
            del self._episodes[key]
        session = self._session_of.pop(response_id, None)
        if session is not None:
            ids = self._sessions.get(session, [])
            if response_id in ids:
                ids.remove(response_id)
            if not ids:
                self._sessions.pop(session, None)

    def get(self, response_id: str) -> TokenRecord | None:
        with self._lock:
            return self._records.get(response_id)

    def pop(self, response_id: str) -> TokenRecord | None:
        with self._lock:
            self._forget(response_id)
            return self._records.pop(response_id, None)

    def pop_session(self, session: str) -> list[TokenRecord]:
        """The session's records in the order they were answered (removed from the recorder)."""
        with self._lock:
            ids = list(self._sessions.get(session, []))
            out = []
            for rid in ids:
                self._forget(rid)
                rec = self._records.pop(rid, None)
                if rec is not None:
                    out.append(rec)
            return out

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
