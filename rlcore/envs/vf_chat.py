"""A tool-less verifiers v1 harness played in the rollout actor's own process.

verifiers' `null` harness runs its chat loop as a separate program (a PEP 723 script launched by
`uv` per rollout, which imports openai, mcp and httpx each time); this one makes the same
exchange with no tools, the task's messages in and the model's reply out through the same
`endpoint` (so verifiers' interception records the trace as it does for `null`), without a
process. `agent.harness.id: null` (Hydra's None) selects it (harness id `rlcore_vf_chat`, see
:func:`rlcore.envs.verifiers_host.null_harness_id`).
"""

from __future__ import annotations

from typing import Any

import verifiers.v1 as vf
from openai import AsyncOpenAI
from verifiers.v1.dialects.chat import message_to_wire
from verifiers.v1.runtimes import ProgramResult


class InProcessChatConfig(vf.HarnessConfig):
    pass


class InProcessChatHarness(vf.Harness[InProcessChatConfig]):
    """One chat completion per episode (no tools), in process; every call goes through `endpoint`."""

    APPENDS_SYSTEM_PROMPT = True
    NEEDS_CONTAINER = False
    EXECUTES_CODE = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, **kwargs) -> ProgramResult:
        system, prompt = self.resolve_prompt(data)
        messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        elif prompt:
            messages += [m if isinstance(m, dict) else message_to_wire(m) for m in prompt]
        client = AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0)
        try:
            await client.chat.completions.create(model=ctx.model, messages=messages)
        finally:
            await client.close()
        return ProgramResult(0, "", "")


__all__ = ["InProcessChatHarness"]
