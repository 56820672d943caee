"""verifiers (classic API) environments run through the OpenAI endpoint with exact token ids.

The environments are defined here (no hub access); the engine is the real HFEngine over the
tiny char model, served on loopback.
"""

import json
import signal
import urllib.request

import pytest
import torch
import verifiers.legacy as vf
from datasets import Dataset

from rlcore.engine.base import SamplingParams
from rlcore.engine.hf_engine import HFEngine
from rlcore.envs.base import make_env
from rlcore.envs.render import TurnRenderer, render_prompt
from rlcore.models.build import build_model, build_tokenizer
from rlcore.serving.openai_server import OpenAIServer

HERE = __name__


def _dataset(n=4):
    return Dataset.from_list([{"question": f"say {c}", "answer": c} for c in "abcdefgh"[:n]])


def single_turn_env():
    """Reward: fraction of completion characters equal to the answer (deterministic in text)."""
    def match(completion, answer, **kwargs):
        if not completion:  # a rollout that errored before its first reply
            return 0.0
        text = completion[-1]["content"] if isinstance(completion, list) else str(completion)
        return sum(ch == answer for ch in text) / max(len(text), 1)

    return vf.SingleTurnEnv(dataset=_dataset(), eval_dataset=_dataset(2), system_prompt="s",
                            rubric=vf.Rubric(funcs=[match]))


class EchoEnv(vf.MultiTurnEnv):
    """Three policy turns; the environment answers each with its turn number."""

    async def env_response(self, messages, state, **kwargs):
        return [{"role": "user", "content": f"turn {len(state['trajectory'])}"}]


def multi_turn_env():
    def turns(state, **kwargs):
        return float(len(state["trajectory"]))

    return EchoEnv(dataset=_dataset(), rubric=vf.Rubric(funcs=[turns]), max_turns=3)


@pytest.fixture(scope="module")
def engine_tok():
    from rlcore.run import compose
    tiny_cfg = compose([])
    tok = build_tokenizer(tiny_cfg.model)
    torch.manual_seed(0)
    model = build_model(tiny_cfg.model, tok)
    return HFEngine(model, tok.pad_token_id, tok.eos_token_id, seed=0), tok


PARAMS = SamplingParams(max_new_tokens=12, temperature=1.0)


def _check_policy_tokens(engine, sample, prompt_ids):
    """Every sampled span's logprobs equal the engine's teacher-forced ones (temperature 1)."""
    ids = prompt_ids + sample.completion_ids
    scored = engine.score(prompt_ids, sample.completion_ids)
    for i, m in enumerate(sample.loss_mask):
        if m:
            assert abs(sample.logprobs[i] - scored[i]) < 1e-4
            assert sample.versions[i] == engine.policy_version
        else:
            assert sample.logprobs[i] == 0.0 and sample.versions[i] == -1
    assert len(ids) == sample.num_tokens


def test_single_turn(engine_tok):
    engine, tok = engine_tok
    before = signal.getsignal(signal.SIGTERM)
    env = make_env("verifiers", {"load": f"{HERE}:single_turn_env", "on_reward_error": "zero"}, seed=0)
    assert signal.getsignal(signal.SIGTERM) is before  # verifiers' handler does not stay installed
    try:
        assert env.eval_size == 2
        tasks = [env.make_task(i, "train") for i in range(2)]
        assert tasks[0].messages[0] == {"role": "system", "content": "s"}
        groups = env.run_groups(tasks, 3, engine, tok, PARAMS)
        assert [len(g.samples) for g in groups] == [3, 3]
        ok = 0
        for g in groups:
            prompt = render_prompt(tok, g.task.messages)
            for s in g.samples:
                assert s.error is None and not s.failed  # an empty completion is scored too
                ok += 1
                assert s.prompt_ids == prompt
                assert s.loss_mask == [1] * len(s.completion_ids)
                _check_policy_tokens(engine, s, prompt)
                text = tok.decode(s.completion_ids, skip_special_tokens=True)
                answer = g.task.answer
                assert s.reward == pytest.approx(sum(c == answer for c in text) / max(len(text), 1))
        assert ok >= 3
        assert len(env._server.recorder) <= 6 - ok  # records of scored rollouts are consumed
    finally:
        env.close()


def test_multi_turn_keeps_exact_ids(engine_tok):
    engine, tok = engine_tok
    env = make_env("verifiers", {"load": f"{HERE}:multi_turn_env", "on_reward_error": "zero"}, seed=0)
    renderer = TurnRenderer(tok)
    try:
        task = env.make_task(0, "train")
        [group] = env.run_groups([task], 4, engine, tok, PARAMS)
        full = [s for s in group.samples if not s.error]
        assert full, [s.error for s in group.samples]
        for s in full:
            assert s.reward == 3.0
            assert s.prompt_ids == render_prompt(tok, task.messages)
            _check_policy_tokens(engine, s, s.prompt_ids)
            # three policy spans separated by exactly the rendered env turns
            spans, cur, env_spans, cur_env = [], [], [], []
            for t, m in zip(s.completion_ids, s.loss_mask):
                if m:
                    if cur_env:
                        env_spans.append(cur_env)
                        cur_env = []
                    cur.append(t)
                else:
                    if cur:
                        spans.append(cur)
                        cur = []
                    cur_env.append(t)
            spans.append(cur)
            assert len(spans) == 3 and len(env_spans) == 2
            for k, (pol, envs) in enumerate(zip(spans, env_spans)):
                assert envs == renderer.continuation(pol, [{"role": "user", "content": f"turn {k + 1}"}])
    finally:
        env.close()


def test_server_protocol_and_errors(engine_tok):
    engine, tok = engine_tok
    with OpenAIServer(engine, tok, defaults=PARAMS, request_timeout_s=30) as server:
        assert server.base_url.startswith("http://127.0.0.1:")

        def post(body):
            req = urllib.request.Request(server.base_url + "/chat/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=30) as r:
                    return r.status, json.loads(r.read())
            except urllib.error.HTTPError as e:
                return e.code, json.loads(e.read())

        msgs = [{"role": "user", "content": "hi"}]
        status, out = post({"model": "m", "messages": msgs, "max_tokens": 5, "logprobs": True})
        assert status == 200 and out["object"] == "chat.completion"
        rec = server.recorder.get(out["id"])
        assert rec.prompt_ids == render_prompt(tok, msgs) and len(rec.completion_ids) <= 5
        assert [c["logprob"] for c in out["choices"][0]["logprobs"]["content"]] == rec.logprobs
        assert out["usage"]["completion_tokens"] == len(rec.completion_ids)
        # prefix rule: the next turn extends the recorded ids exactly
        nxt = [*msgs, out["choices"][0]["message"], {"role": "user", "content": "more"}]
        assert server.prompt_ids(nxt)[:len(rec.prompt_ids) + len(rec.completion_ids)] == \
            rec.prompt_ids + rec.completion_ids
        assert post({"messages": msgs, "n": 2})[0] == 400
        assert post({"messages": msgs, "stop": ["x"]})[0] == 400
        assert post({"messages": []})[0] == 400


@pytest.mark.integration
def test_verifiers_env_trains_end_to_end(tmp_path):
    """Two RL steps of the full loop (local Ray cluster, CPU) on the single-turn env above."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "rlcore.run", "env=verifiers",
                           "env.args.load=test_verifiers_env:single_turn_env", "+env.args.on_reward_error=zero",
                           "steps=2", "sft.warmup_steps=0", f"output_dir={out}"],
                          capture_output=True, text=True, timeout=300, env=env, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["mismatch_kl"] < 1e-6  # on-policy first step: recorded logprobs are the trainer's
