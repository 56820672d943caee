"""A verifiers v1 environment: multiply numbers too long to multiply in the head, with a calculator.

Taskset id `rlcore.envs.vf_calculator` (`env=verifiers env.args.taskset=rlcore.envs.vf_calculator`,
recipe `vf_calculator`). Each task is `A*B=` with `digits`-digit factors; the harness is a chat
loop of at most `max_turns` model calls offering one tool, `calc(expr)`, whose calls the endpoint
parses from the model's hermes `<tool_call>` blocks; the reward is 1 when the last reply is the
exact product, plus 0.5 when the calculator was called with the task's expression copied
exactly (max 1.5). Each task also carries a demonstration (call the tool with the expression, read
the result, answer it) for the supervised warm-up (`sft.dataset=env`).
"""

from __future__ import annotations

import json
import random
from typing import Any

import verifiers.v1 as vf
from openai import AsyncOpenAI
from verifiers.v1.runtimes import ProgramResult

from rlcore.envs.tool_use import calculate

CALC_TOOL = {
    "type": "function",
    "function": {
        "name": "calc",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}, "required": ["expr"]},
    },
}


def call_text(expr: str) -> str:
    """How a model writes a `calc` call in the hermes format."""
    return "<tool_call>" + json.dumps({"name": "calc", "arguments": {"expr": expr}}) + "</tool_call>"


class CalculatorData(vf.TaskData):
    answer: str = ""
    demonstration: list[dict[str, Any]] = []
    """Reference turns after the prompt (assistant call, tool result, assistant answer)."""


class CalculatorTask(vf.Task[CalculatorData]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        """1 when the last reply is exactly the product."""
        replies = [m.content for m in trace.messages if m.role == "assistant" and not getattr(m, "tool_calls", None)]
        return 1.0 if replies and (replies[-1] or "").strip() == self.data.answer else 0.0

    @vf.reward(weight=0.5)
    async def called_calculator(self, trace: vf.Trace) -> float:
        """1 when the calculator was called with the task's expression, copied exactly."""
        expr = (self.data.prompt or "").rstrip("=")
        for m in trace.messages:
            for call in getattr(m, "tool_calls", None) or []:
                try:
                    if call.name == "calc" and json.loads(call.arguments).get("expr") == expr:
                        return 1.0
                except (ValueError, AttributeError):
                    continue
        return 0.0


class CalculatorConfig(vf.TasksetConfig):
    num_tasks: int = 4096
    """How many tasks the taskset holds."""
    digits: int = 2
    """Digits of each factor."""
    seed: int = 0
    """Seed of the factors."""


class CalculatorTaskset(vf.Taskset[CalculatorTask, CalculatorConfig]):
    def load(self) -> list[CalculatorTask]:
        rng = random.Random(self.config.seed)
        lo, hi = 10 ** (self.config.digits - 1), 10**self.config.digits - 1
        tasks = []
        for _ in range(self.config.num_tasks):
            expr = f"{rng.randint(lo, hi)}*{rng.randint(lo, hi)}"
            answer = calculate(expr)
            demo = [
                {"role": "assistant", "content": call_text(expr)},
                {"role": "tool", "content": answer},
                {"role": "assistant", "content": answer},
            ]
            tasks.append(
                CalculatorTask(CalculatorData(prompt=f"{expr}=", answer=answer, demonstration=demo), self.config.task)
            )
        return tasks


class CalculatorHarnessConfig(vf.HarnessConfig):
    max_turns: int = 3
    """Model calls per episode."""


class CalculatorHarness(vf.Harness[CalculatorHarnessConfig]):
    """In-process chat loop with the `calc` tool; every model call goes through `endpoint`."""

    APPENDS_SYSTEM_PROMPT = True
    NEEDS_CONTAINER = False
    EXECUTES_CODE = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, **kwargs) -> ProgramResult:
        client = AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0)
        messages: list[dict[str, Any]] = [{"role": "user", "content": data.prompt}]
        try:
            for _ in range(self.config.max_turns):
                reply = await client.chat.completions.create(model=ctx.model, messages=messages, tools=[CALC_TOOL])
                msg = reply.choices[0].message
                messages.append(msg.model_dump(exclude_none=True))
                if not msg.tool_calls:
                    break
                for call in msg.tool_calls:
                    try:
                        result = calculate(str(json.loads(call.function.arguments)["expr"]))
                    except Exception as e:  # noqa: BLE001 (the model reads the tool's error)
                        result = f"error: {type(e).__name__}"
                    messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        finally:
            await client.close()
        return ProgramResult(0, "", "")


__all__ = ["CalculatorTaskset", "CalculatorHarness"]
