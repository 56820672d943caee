"""The OpenAI endpoint's tool-call parsing through vLLM's own parser registry (where vLLM is
installed) agrees with the built-in CPU `hermes` parser the transformers engine's tests cover.

Run on the lent machine from the repo root:

    PYTHONPATH=$PWD:$PYTHONPATH python -m pytest -m gpu tests/gpu/test_vllm_tool_parser.py -v
"""

from __future__ import annotations

import importlib.util
import json

import pytest

pytestmark = [
    pytest.mark.gpu(gpus=1),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm"),
]

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calc",
            "description": "evaluate an expression",
            "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}},
        },
    }
]
TEXTS = [
    '<tool_call>\n{"name": "calc", "arguments": {"expr": "11*14"}}\n</tool_call>',
    'first <tool_call>\n{"name": "calc", "arguments": {"expr": "1+2"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "calc", "arguments": {"expr": "3"}}\n</tool_call>',
    "no call here",
]


def _tokenizer():
    """The char tokenizer with Qwen's `<tool_call>` markers as single added (not special) tokens,
    as in Qwen3's tokenizer (vLLM's hermes parser looks them up in the vocabulary); nothing is
    downloaded."""
    from rlcore.models.tokenizer import char_tokenizer

    tok = char_tokenizer()
    tok.add_tokens(["<tool_call>", "</tool_call>"])
    return tok


def _norm(turn):
    return turn.content, [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in turn.tool_calls]


def test_vllm_hermes_matches_builtin():
    from rlcore.serving.tool_parsers import make_tool_parser, parse_hermes

    tok = _tokenizer()
    vllm_parse = make_tool_parser("hermes", tok, use_vllm=True)
    assert vllm_parse is not parse_hermes
    for text in TEXTS:
        assert _norm(vllm_parse(text, TOOLS)) == _norm(parse_hermes(text, TOOLS)), text
    with pytest.raises(ValueError, match="tool_parser"):
        make_tool_parser("no_such_parser", tok, use_vllm=True)


def test_server_uses_vllm_parser():
    """The server's choice for a generation that spells a tool call (the vLLM registry path)."""
    from rlcore.engine.base import Generation, SamplingParams
    from rlcore.engine.hf_engine import HFEngine
    from rlcore.models.build import build_model
    from rlcore.plan.compose import compose
    from rlcore.serving.openai_server import OpenAIServer

    tok = _tokenizer()
    cfg = compose([])
    model = build_model(cfg.model, tok)
    server = OpenAIServer(HFEngine(model, tok.pad_token_id, tok.eos_token_id), tok, defaults=SamplingParams())
    ids = tok(TEXTS[0], add_special_tokens=False).input_ids + [tok.eos_token_id]
    gen = Generation(token_ids=ids, logprobs=[0.0] * len(ids), versions=[0] * len(ids), finish_reason="stop")
    choice, kept, content, calls = server._choice(0, gen, {"tools": TOOLS}, TOOLS, [])
    assert choice["finish_reason"] == "tool_calls" and kept.token_ids == ids
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("calc", {"expr": "11*14"})
    ]
