"""Tool calling in completions: the text format, parsing, and a multi-turn tool environment.

Format (plain text, so it works with any tokenizer, including the built-in character one):

    <tool>NAME: ARGUMENT</tool>      call tool NAME; ARGUMENT is everything up to </tool>
                                     (it may span lines; surrounding whitespace is stripped)
    <answer>TEXT</answer>            the final answer; ends the episode

The environment replies with one message holding a ``<result>NAME: OUTPUT</result>`` block per
call, in order. A turn with neither a call nor an answer ends the episode.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable

from rlcore.envs.base import Message
from rlcore.envs.multiturn import MultiTurnEnvironment
from rlcore.isolation.safety import call_with_deadline
from rlcore.types import Task

_CALL = re.compile(r"<tool>\s*([A-Za-z_][\w-]*)\s*:?(.*?)</tool>", re.DOTALL)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)

Tool = Callable[[str, dict[str, Any]], str]
"""A tool: (argument, episode state) -> output text. Raising reports the error to the policy."""


@dataclass
class ToolCall:
    name: str
    argument: str


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every well-formed `<tool>NAME: ARG</tool>` in `text`, in order."""
    return [ToolCall(m.group(1), m.group(2).strip()) for m in _CALL.finditer(text)]


def parse_answer(text: str) -> str | None:
    """The content of the last `<answer>...</answer>`, stripped, or None."""
    found = _ANSWER.findall(text)
    return found[-1].strip() if found else None


def last_answer(history: list[Message]) -> str | None:
    """The final answer given anywhere in the episode (the last one wins)."""
    for m in reversed(history):
        if m["role"] == "assistant":
            a = parse_answer(m["content"])
            if a is not None:
                return a
    return None


class ToolEnvironment(MultiTurnEnvironment):
    """A multi-turn environment whose replies are tool results.

    Subclasses set `self.tools` (name -> :data:`Tool`) and implement `make_task` and `score`.
    Each call runs under `tool_timeout_s`; an error or timeout is shown to the policy as the
    tool's output (that is feedback, not an environment fault). Outputs are cut at
    `max_tool_output` characters so tool text cannot flood the context.
    """

    result_role = "user"  # the most portable role across chat templates for tool output

    def __init__(
        self,
        seed: int = 0,
        tool_timeout_s: float = 2.0,
        max_tool_output: int = 400,
        max_calls_per_turn: int = 4,
        **kwargs,
    ):
        super().__init__(seed, **kwargs)
        if tool_timeout_s <= 0:
            raise ValueError(f"env.args.tool_timeout_s: must be > 0, got {tool_timeout_s}")
        if max_tool_output < 1:
            raise ValueError(f"env.args.max_tool_output: must be >= 1, got {max_tool_output}")
        if max_calls_per_turn < 1:
            raise ValueError(f"env.args.max_calls_per_turn: must be >= 1, got {max_calls_per_turn}")
        self.tool_timeout_s, self.max_tool_output = float(tool_timeout_s), int(max_tool_output)
        self.max_calls_per_turn = int(max_calls_per_turn)
        # env_response (all of a turn's calls) runs under env.reward.timeout_s: it must fit them
        deadline = self.reward_runtime.timeout_s
        if deadline and deadline < tool_timeout_s * max_calls_per_turn:
            raise ValueError(
                f"env.reward.timeout_s: must be >= env.args.tool_timeout_s * env.args.max_calls_per_turn "
                f"({tool_timeout_s} * {max_calls_per_turn}), got {deadline}"
            )
        self.tools: dict[str, Tool] = {}

    def call_tool(self, call: ToolCall, state: dict[str, Any]) -> str:
        """Run one call under the tool deadline; the text the policy will see."""
        tool = self.tools.get(call.name)
        if tool is None:
            return f"error: unknown tool {call.name!r}; tools: {', '.join(sorted(self.tools))}"
        outcome = call_with_deadline(tool, call.argument, state, timeout_s=self.tool_timeout_s)
        text = str(outcome.value) if outcome.ok else f"error: {outcome.error}"
        if len(text) > self.max_tool_output:
            text = text[: self.max_tool_output] + "...(truncated)"
        state["tool_calls"] = state.get("tool_calls", 0) + 1
        return text

    def env_response(self, task: Task, history: list[Message], state: dict[str, Any]) -> tuple[list[Message], bool]:
        text = history[-1]["content"]
        if parse_answer(text) is not None:
            return [], True
        calls = parse_tool_calls(text)[: self.max_calls_per_turn]
        if not calls:
            return [], True
        results = "".join(f"<result>{c.name}: {self.call_tool(c, state)}</result>" for c in calls)
        return [{"role": self.result_role, "content": results}], False
