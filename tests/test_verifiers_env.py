"""verifiers v1 environments and tool calls through the OpenAI endpoint, with exact token ids.

This module is also the v1 taskset `test_verifiers_env` (verifiers resolves a taskset id by
importing it and reading `__all__`): `CalcTaskset` (multiply two numbers) played by `CalcHarness`,
an in-process chat loop with one tool (`calc`). The engine is the real HFEngine over the tiny
char model; where a test needs the model to call the tool, the model is first trained (a few
dozen optimizer steps) to answer the task with a hermes `<tool_call>` block.
"""

import json
import shutil
import urllib.request

import pytest
import torch
import verifiers.v1 as vf
from openai import AsyncOpenAI
from verifiers.v1.runtimes import ProgramResult

from rlcore.config.reward import RewardRuntimeConfig
from rlcore.engine.base import SamplingParams
from rlcore.engine.hf_engine import HFEngine
from rlcore.envs import make_env
from rlcore.envs.tool_use import calculate
from rlcore.models.build import build_model, build_tokenizer
from rlcore.models.render import TurnRenderer
from rlcore.serving.openai_server import OpenAIServer
from rlcore.serving.records import TokenRecord, normalize_messages
from rlcore.serving.tool_parsers import parse_hermes

# ---- the v1 environment under test ---------------------------------------------------------


class CalcData(vf.TaskData):
    answer: str = ""


class CalcTask(vf.Task[CalcData]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        reply = next((m.content for m in reversed(trace.messages) if m.role == "assistant" and m.content), "")
        return 1.0 if self.data.answer in (reply or "") else 0.0


class CalcConfig(vf.TasksetConfig):
    num_tasks: int = 4


class CalcTaskset(vf.Taskset[CalcTask, CalcConfig]):
    def load(self):
        return [
            CalcTask(CalcData(prompt=f"{a}*{a + 3}=", answer=str(a * (a + 3))), self.config.task)
            for a in range(11, 11 + self.config.num_tasks)
        ]


CALC = {"type": "function", "function": {"name": "calc", "parameters": {"expr": "str"}}}


class CalcHarness(vf.Harness[vf.HarnessConfig]):
    """Chat loop with the `calc` tool: at most 3 model calls; tool results are sent back."""

    APPENDS_SYSTEM_PROMPT = True
    NEEDS_CONTAINER = False
    EXECUTES_CODE = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, **kwargs):
        client = AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0)
        messages = [{"role": "user", "content": data.prompt}]
        try:
            for _ in range(3):
                reply = await client.chat.completions.create(model=ctx.model, messages=messages, tools=[CALC])
                msg = reply.choices[0].message
                messages.append(msg.model_dump(exclude_none=True))
                if not msg.tool_calls:
                    break
                for call in msg.tool_calls:
                    try:
                        result = calculate(json.loads(call.function.arguments)["expr"])
                    except Exception as e:  # noqa: BLE001 (the model sees the tool's error)
                        result = f"error: {e}"
                    messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        finally:
            await client.close()
        return ProgramResult(0, "", "")


__all__ = ["CalcTaskset", "CalcHarness"]

# ---- a Qwen3-style chat template: tools block, hermes tool calls, <tool_response> turns, and
# reasoning dropped from assistant turns before the last user message --------------------------
QWEN3_STYLE = (
    "{% if tools %}{{ '<|im_start|>system\\n<tools>' + (tools | tojson) + '</tools><|im_end|>\\n' }}{% endif %}"
    "{% set ns = namespace(last=-1) %}"
    "{% for m in messages %}{% if m.role == 'user' %}{% set ns.last = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}"
    "{% if m.role in ['user', 'system'] %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{% elif m.role == 'assistant' %}{% set c = m.content or '' %}"
    "{% if '</think>' in c and loop.index0 < ns.last %}{% set c = c.split('</think>')[-1].lstrip('\\n') %}{% endif %}"
    "{{ '<|im_start|>assistant\\n' + c }}"
    '{% for tc in m.tool_calls or [] %}{{ \'<tool_call>\\n{"name": "\' + tc.function.name + \'", "arguments": \' }}'
    "{% if tc.function.arguments is string %}{{ tc.function.arguments }}{% else %}{{ tc.function.arguments | tojson }}"
    "{% endif %}{{ '}\\n</tool_call>' }}{% endfor %}{{ '<|im_end|>\\n' }}"
    "{% elif m.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{ '<|im_start|>user' }}{% endif %}"
    "{{ '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{ '<|im_end|>\\n' }}{% endif %}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

CALL_TEXT = '<tool_call>{"name": "calc", "arguments": {"expr": "11*14"}}</tool_call>'


def _tiny(max_positions=512):
    from rlcore.plan.compose import compose

    cfg = compose([f"model.arch.max_position_embeddings={max_positions}"])
    tok = build_tokenizer(cfg.model)
    torch.manual_seed(0)
    return build_model(cfg.model, tok), tok


def _memorize(model, pairs, max_steps=300):
    """Train `model` until it answers each (prompt ids, target ids) pair greedily: every target
    token is the argmax after its teacher-forced prefix (checked before each update)."""
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    batch = [(torch.tensor([p + t]), torch.tensor([[-100] * len(p) + t]), len(p)) for p, t in pairs]
    for step in range(max_steps):
        opt.zero_grad()
        learned = True
        for ids, labels, n in batch:
            out = model(input_ids=ids, labels=labels)
            learned &= bool((out.logits[0, n - 1 : -1].argmax(-1) == ids[0, n:]).all())
            out.loss.backward()
        if learned:
            break
        opt.step()
    else:
        raise AssertionError(f"the model did not learn its demonstrations in {max_steps} steps")
    model.eval()
    return step


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread, as the rollout actors run (on a shared 2-core box, more threads make
    these small models tens of times slower)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tool_engine():
    """An engine whose model answers the first task (11*14) with CALL_TEXT, under QWEN3_STYLE."""
    model, tok = _tiny()
    tok.chat_template = QWEN3_STYLE
    server = OpenAIServer(HFEngine(model, tok.pad_token_id, tok.eos_token_id, seed=0), tok)
    prompt, _ = server.prompt_ids(normalize_messages([{"role": "user", "content": "11*14="}]), [CALC])
    _memorize(model, [(prompt, tok(CALL_TEXT, add_special_tokens=False).input_ids + [tok.eos_token_id])])
    return HFEngine(model, tok.pad_token_id, tok.eos_token_id, seed=0), tok


GREEDY = SamplingParams(max_new_tokens=80, temperature=0.0)


def _post(server, body, headers=None):
    req = urllib.request.Request(
        server.base_url + "/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _check_policy_tokens(engine, sample):
    """Every sampled token's logprob equals the engine's teacher-forced one (temperature 1)."""
    scored = engine.score(sample.prompt_ids, sample.completion_ids)
    for i, m in enumerate(sample.loss_mask):
        if m:
            assert abs(sample.logprobs[i] - scored[i]) < 1e-4
            assert sample.versions[i] == engine.policy_version
        else:
            assert sample.logprobs[i] == 0.0 and sample.versions[i] == -1


# ---- parsing --------------------------------------------------------------------------------


def test_hermes_parser():
    p = parse_hermes(
        'let me see <tool_call>\n{"name": "calc", "arguments": {"expr": "2+3"}}\n</tool_call>'
        '<tool_call>{"name": "calc", "arguments": "{\\"expr\\": \\"1\\"}"}</tool_call>'
    )
    assert p.content == "let me see"
    assert [c["function"]["name"] for c in p.tool_calls] == ["calc", "calc"]
    assert json.loads(p.tool_calls[0]["function"]["arguments"]) == {"expr": "2+3"}
    assert p.tool_calls[1]["function"]["arguments"] == '{"expr": "1"}'  # a JSON string stays as sent
    assert p.tool_calls[0]["id"] != p.tool_calls[1]["id"] and p.tool_calls[0]["type"] == "function"
    assert parse_hermes("<tool_call>not json</tool_call>").tool_calls == []  # left as content
    assert parse_hermes('<tool_call>{"arguments": {}}</tool_call>').tool_calls == []  # no name
    unclosed = parse_hermes('<tool_call>{"name": "f", "arguments": {}}')
    assert unclosed.tool_calls[0]["function"]["name"] == "f" and unclosed.content == ""


# ---- the server -----------------------------------------------------------------------------


def test_server_n_stop_logprobs():
    model, tok = _tiny()
    engine = HFEngine(model, tok.pad_token_id, tok.eos_token_id, seed=0)
    msgs = [{"role": "user", "content": "hi"}]
    with OpenAIServer(engine, tok, defaults=SamplingParams(max_new_tokens=20), request_timeout_s=60) as server:
        status, out = _post(server, {"messages": msgs, "n": 3, "logprobs": True, "seed": 5})
        assert status == 200 and [c["index"] for c in out["choices"]] == [0, 1, 2]
        recs = [server.recorder.get(out["id"] if i == 0 else f"{out['id']}-{i}") for i in range(3)]
        assert len({tuple(r.completion_ids) for r in recs}) > 1  # independent samples
        for c, r in zip(out["choices"], recs):
            assert [t["logprob"] for t in c["logprobs"]["content"]] == r.logprobs
            assert "".join(t["token"] for t in c["logprobs"]["content"]) == tok.decode(r.completion_ids)
        assert out["usage"]["completion_tokens"] == sum(len(r.completion_ids) for r in recs)
        # stop strings: the text ends before the stop string, the ids end with the token completing it
        text = tok.decode(recs[0].completion_ids, skip_special_tokens=True)
        stop = text[3:5]
        status, out2 = _post(server, {"messages": msgs, "seed": 5, "stop": [stop, "\x00never"]})
        rec = server.recorder.get(out2["id"])
        content = out2["choices"][0]["message"]["content"]
        assert content == text[: text.find(stop)] and out2["choices"][0]["finish_reason"] == "stop"
        assert rec.completion_ids == recs[0].completion_ids[: len(rec.completion_ids)]
        assert tok.decode(rec.completion_ids, skip_special_tokens=True).endswith(stop)
        assert rec.logprobs == recs[0].logprobs[: len(rec.completion_ids)]
        # streaming: the same reply as server-sent chunk events, then the usage, then [DONE]
        req = urllib.request.Request(
            server.base_url + "/chat/completions",
            headers={"Content-Type": "application/json"},
            data=json.dumps(
                {"messages": msgs, "seed": 5, "stream": True, "stream_options": {"include_usage": True}}
            ).encode(),
        )
        with urllib.request.urlopen(req, timeout=60) as r:
            assert r.headers["Content-Type"].startswith("text/event-stream")
            events = [line[6:] for line in r.read().decode().splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]) == text
        assert chunks[-2]["choices"][0]["finish_reason"] in ("stop", "length")
        assert chunks[-1]["usage"]["completion_tokens"] == len(recs[0].completion_ids)
        for bad in ({"top_logprobs": 2}, {"n": 0}, {"stop": 3}, {"messages": []}):
            assert _post(server, {"messages": msgs, **bad})[0] == 400


def test_prefix_break_is_detected_and_spliced():
    """Qwen3-style templates drop <think> from earlier assistant turns: a fresh rendering no
    longer extends the sampled ids. The server splices the recorded ids and marks the break."""
    model, tok = _tiny()
    tok.chat_template = QWEN3_STYLE
    server = OpenAIServer(HFEngine(model, tok.pad_token_id, tok.eos_token_id), tok)
    first = normalize_messages([{"role": "user", "content": "q1"}])
    prompt, brk = server.prompt_ids(first)
    assert not brk
    for reply, breaks in (("<think>hm</think>a1", True), ("a1", False)):
        completion = tok(reply, add_special_tokens=False).input_ids + [tok.eos_token_id]
        server.recorder.add(
            reply, first, TokenRecord(prompt, completion, [0.0] * len(completion), [0] * len(completion), "stop", reply)
        )
        nxt = normalize_messages([*first, {"role": "assistant", "content": reply}, {"role": "user", "content": "q2"}])
        ids, brk = server.prompt_ids(nxt)
        assert ids[: len(prompt) + len(completion)] == prompt + completion  # exact continuation
        assert ids[len(prompt) + len(completion) :] == TurnRenderer(tok).continuation(completion, nxt[2:])
        assert brk is breaks
        assert (server.render(nxt)[: len(prompt) + len(completion)] != prompt + completion) is breaks


def test_tool_call_round_trip(tool_engine):
    """model text -> parsed tool_calls -> tool message -> the next turn's exact ids."""
    engine, tok = tool_engine
    with OpenAIServer(engine, tok, defaults=GREEDY, request_timeout_s=60) as server:
        msgs = [{"role": "user", "content": "11*14="}]
        status, out = _post(server, {"messages": msgs, "tools": [CALC]}, {"X-Session-ID": "s1"})
        assert status == 200, out
        choice = out["choices"][0]
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
        [call] = choice["message"]["tool_calls"]
        assert call["function"]["name"] == "calc" and json.loads(call["function"]["arguments"]) == {"expr": "11*14"}
        rec1 = server.recorder.get(out["id"])
        assert tok.decode(rec1.completion_ids, skip_special_tokens=True) == CALL_TEXT
        # without tools (or tool_choice none) the same text is plain content
        _, plain = _post(server, {"messages": msgs, "tools": [CALC], "tool_choice": "none"})
        assert plain["choices"][0]["message"]["content"] == CALL_TEXT
        tool_msg = {"role": "tool", "tool_call_id": call["id"], "content": calculate("11*14")}
        nxt = [*msgs, choice["message"], tool_msg]
        status, out2 = _post(server, {"messages": nxt, "tools": [CALC], "max_tokens": 5}, {"X-Session-ID": "s1"})
        assert status == 200
        rec2 = server.recorder.get(out2["id"])
        context = rec1.prompt_ids + rec1.completion_ids
        assert rec2.prompt_ids[: len(context)] == context
        delta = tok.decode(rec2.prompt_ids[len(context) :])
        assert delta == "\n<|im_start|>user\n<tool_response>\n154\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
        # the template would re-render the call with newlines: a break, spliced over
        assert rec2.prefix_break
        assert [r.prompt_ids for r in server.recorder.pop_session("s1")] == [rec1.prompt_ids, rec2.prompt_ids]


# ---- the v1 environment ---------------------------------------------------------------------


def _env(**args):
    # CalcHarness is this module's own: rlcore does not know it, so the test vouches for it
    return make_env(
        "verifiers",
        {
            "taskset": __name__,
            "allow_host_tools": True,
            "env_config": {"taskset": {"num_tasks": 2}},
            **args,
        },
        seed=0,
        reward_runtime=RewardRuntimeConfig(on_error="zero"),
    )


def test_v1_env_tool_episode(tool_engine):
    """v1 episodes with a real tool call through verifiers' interception: each sample is exactly
    the server's record of both turns (tool result masked), and the task's reward scores it."""
    engine, tok = tool_engine
    env = _env()
    try:
        assert env.eval_size == 2
        task = env.make_task(0, "eval")
        assert task.messages == [{"role": "user", "content": "11*14="}] and task.answer == "154"
        server = env.server(engine, tok)
        seen = []  # the records the environment reads back, as the server kept them
        pop_session = server.recorder.pop_session
        server.recorder.pop_session = lambda sid: seen.append(pop_session(sid)) or seen[-1]
        [group] = env.run_groups([task], 2, engine, tok, GREEDY)
        assert len(seen) == 2 and all(len(records) == 2 for records in seen)  # two model calls each
        for s, (rec1, rec2) in zip(group.samples, seen):
            assert not s.failed and s.error is None, s.error
            assert s.prompt_ids == rec1.prompt_ids == server.render(normalize_messages(task.messages), [CALC])
            assert tok.decode(rec1.completion_ids, skip_special_tokens=True) == CALL_TEXT
            assert rec1.tool_calls[0]["function"]["name"] == "calc"
            context = rec1.prompt_ids + rec1.completion_ids
            env_ids = rec2.prompt_ids[len(context) :]
            assert rec2.prompt_ids[: len(context)] == context
            assert (
                tok.decode(env_ids)
                == "\n<|im_start|>user\n<tool_response>\n154\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
            )
            assert s.completion_ids == rec1.completion_ids + env_ids + rec2.completion_ids
            assert s.loss_mask == [1] * len(rec1.completion_ids) + [0] * len(env_ids) + [1] * len(rec2.completion_ids)
            assert s.logprobs == rec1.logprobs + [0.0] * len(env_ids) + rec2.logprobs
            assert s.versions == rec1.versions + [-1] * len(env_ids) + rec2.versions
            assert s.prefix_breaks == 1  # the template re-renders the call with newlines
            final = (rec2.tool_calls is None) and rec2.text.strip() == "154"
            assert s.reward == (1.0 if final else 0.0)
        assert len(server.recorder) == 0  # every record of the episodes was consumed
    finally:
        env.close()


def test_v1_env_empty_reply_is_scored():
    """A reply that is only the end-of-turn token is an ordinary sample: trained, rubric-scored."""
    model, tok = _tiny()
    env = _env()
    try:
        task = env.make_task(0, "eval")
        prompt = env.server(HFEngine(model, tok.pad_token_id, tok.eos_token_id), tok).render(task.messages, [CALC])
        _memorize(model, [(prompt, [tok.eos_token_id])])
        engine = HFEngine(model, tok.pad_token_id, tok.eos_token_id, seed=0)
        for _ in range(2):  # later calls run on the loop verifiers' locks were bound to
            [group] = env.run_groups([task], 2, engine, tok, SamplingParams(max_new_tokens=8, temperature=0.0))
            for s in group.samples:
                assert s.completion_ids == [tok.eos_token_id] and s.loss_mask == [1]
                assert not s.failed and s.error is None and s.reward == 0.0
    finally:
        env.close()


def test_v1_env_bad_taskset_is_a_config_error():
    with pytest.raises(ValueError, match="env.args.taskset"):
        make_env("verifiers", {"taskset": "no_such_taskset_xyz"}, seed=0)
    with pytest.raises(ValueError, match="env.args.taskset"):
        make_env("verifiers", {}, seed=0)
    with pytest.raises(ValueError, match="env.args.tool_parser"):
        _env(tool_parser="no_such_parser")


# the README's example taskset, written as a module of its own
README_TASKSET = """
import verifiers.v1 as vf

class Data(vf.TaskData):
    answer: str = ""

class CalcTask(vf.Task[Data]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        return float(self.data.answer in trace.last_reply)

class CalcTaskset(vf.Taskset[CalcTask, vf.TasksetConfig]):
    def load(self):
        return [CalcTask(Data(prompt=f"{a}*{a + 7}=", answer=str(a * (a + 7))), self.config.task) for a in range(100)]

__all__ = ["CalcTaskset"]
"""


@pytest.mark.integration
@pytest.mark.skipif(shutil.which("uv") is None, reason="verifiers' shipped harnesses run their program through uv")
@pytest.mark.parametrize("harness", ["null", "bash"])
def test_shipped_harness_runs_unmodified(tmp_path, monkeypatch, harness):
    """verifiers' own chat harnesses (`null`; `bash`, a taskset's default) play the README's
    taskset against the endpoint: a separate program (a PEP 723 script run by uv) that streams."""
    (tmp_path / "readme_calc.py").write_text(README_TASKSET)
    monkeypatch.syspath_prepend(str(tmp_path))
    model, tok = _tiny()
    engine = HFEngine(model, tok.pad_token_id, tok.eos_token_id, seed=0)
    env = make_env(
        "verifiers",
        {
            "taskset": "readme_calc",
            "env_config": {"agent": {"harness": {"id": harness}}},
            "allow_host_tools": harness == "bash",
        },
        seed=0,
        reward_runtime=RewardRuntimeConfig(on_error="zero"),
    )  # bash runs its shell here
    try:
        [group] = env.run_groups([env.make_task(0, "train")], 2, engine, tok, SamplingParams(max_new_tokens=8))
        for s in group.samples:
            assert not s.failed and s.error is None, s.error
            assert s.loss_mask == [1] * len(s.completion_ids) and s.completion_ids
            _check_policy_tokens(engine, s)
            assert s.reward in (0.0, 1.0)
    finally:
        env.close()


@pytest.mark.integration
def test_v1_env_trains_end_to_end(tmp_path):
    """Two RL steps of the full loop (local Ray cluster, CPU) on the v1 env above."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlcore.run",
            "env=verifiers",
            "env.args.taskset=test_verifiers_env",
            "env.reward.on_error=zero",
            "env.args.allow_host_tools=true",
            "steps=2",
            "sft.warmup_steps=0",
            f"output_dir={out}",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["mismatch_kl"] < 1e-6  # on-policy first step: recorded logprobs are the trainer's
    assert "multiturn_prefix_breaks" in rows[0]
