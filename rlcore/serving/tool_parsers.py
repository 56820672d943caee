"""Tool-call parsing for the OpenAI-compatible server: model text -> OpenAI `tool_calls`.

`make_tool_parser(name, tokenizer, use_vllm)` returns a callable `parse(text, tools) ->
ParsedTurn`:

- on the vLLM engine, vLLM's own parser registry (`ToolParserManager`, every parser vLLM ships:
  `hermes` for Qwen2.5/Qwen3, `llama3_json`, `mistral`, ...);
- on the transformers engine (CPU, no vLLM installed), this module's `hermes` parser: the
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` format of Qwen2.5/Qwen3's chat
  templates. Only that format is implemented here; other names need vLLM.

`none` turns parsing off (the reply text is the message content). A block that is not a JSON
object with a string `name` is left in the content, as vLLM's hermes parser does.
"""

from __future__ import annotations

import importlib.util
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

HERMES_CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)$", re.DOTALL)


@dataclass
class ParsedTurn:
    """An assistant reply split into its text content and its tool calls."""

    content: str
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    """OpenAI form: {"id", "type": "function", "function": {"name", "arguments": JSON string}}."""


def tool_call(name: str, arguments: Any, call_id: str | None = None) -> dict[str, Any]:
    """One OpenAI `tool_calls` entry (arguments serialized to a JSON string, as OpenAI sends them)."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments if arguments is not None else {})
    return {
        "id": call_id or f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": args},
    }


def parse_hermes(text: str, tools: list[dict[str, Any]] | None = None) -> ParsedTurn:
    """Hermes / Qwen format: each `<tool_call>JSON</tool_call>` block with a JSON object holding a
    string `name` (and `arguments`) becomes a call; the content is the text before the first
    parsed block (stripped), as vLLM's hermes parser returns it. An unclosed last block is parsed
    too (generation stopped on the end-of-turn token before `</tool_call>`)."""
    calls, first = [], None
    for m in HERMES_CALL.finditer(text):
        body = (m.group(1) if m.group(1) is not None else m.group(2)).strip()
        try:
            obj = json.loads(body)
        except json.JSONDecodeError:
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            continue
        calls.append(tool_call(obj["name"], obj.get("arguments", obj.get("parameters", {}))))
        first = m.start() if first is None else first
    if not calls:
        return ParsedTurn(content=text)
    return ParsedTurn(content=text[:first].strip(), tool_calls=calls)


def _vllm_parser(name: str, tokenizer: Any) -> Callable[[str, list | None], ParsedTurn]:
    try:  # vLLM >= 0.11 moved the parsers out of the OpenAI entrypoint package
        from vllm.tool_parsers import ToolParserManager
    except ImportError:
        from vllm.entrypoints.openai.tool_parsers import ToolParserManager
    try:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    except ImportError:
        from vllm.entrypoints.openai.protocol import ChatCompletionRequest
    parser = ToolParserManager.get_tool_parser(name)(tokenizer)

    def parse(text: str, tools: list | None) -> ParsedTurn:
        request = ChatCompletionRequest(model="rlcore", messages=[], tools=tools or None)
        info = parser.extract_tool_calls(text, request)
        if not info.tools_called:
            return ParsedTurn(content=text)
        return ParsedTurn(
            content=(info.content or "").strip(),
            tool_calls=[tool_call(c.function.name, c.function.arguments, c.id) for c in info.tool_calls],
        )

    return parse


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


def check_tool_parser(name: str) -> None:
    """Raise ValueError (naming `tool_parser`) unless `name` is a parser this process can build."""
    if not name or name in ("none", "hermes"):
        return
    if not vllm_available():
        raise ValueError(
            f"tool_parser: {name!r} needs vLLM's parser registry (vLLM is not installed); "
            "the built-in parser is 'hermes' (or 'none')"
        )
    try:
        from vllm.tool_parsers import ToolParserManager
    except ImportError:
        from vllm.entrypoints.openai.tool_parsers import ToolParserManager
    try:
        ToolParserManager.get_tool_parser(name)
    except KeyError as e:
        raise ValueError(f"tool_parser: vLLM has no tool parser {name!r}") from e


def make_tool_parser(name: str, tokenizer: Any, use_vllm: bool) -> Callable[[str, list | None], ParsedTurn] | None:
    """The parser named `name` (None for `none`/empty): vLLM's registry on vLLM engines,
    this module's `hermes` on the transformers engine. Raises ValueError for an unknown name."""
    if not name or name == "none":
        return None
    if use_vllm:
        try:
            return _vllm_parser(name, tokenizer)
        except KeyError as e:
            raise ValueError(f"tool_parser: vLLM has no tool parser {name!r}") from e
    if name != "hermes":
        raise ValueError(
            f"tool_parser: {name!r} needs the vLLM engine; the transformers engine implements 'hermes' (or 'none')"
        )
    return parse_hermes
