"""The vf_calculator recipe's rubric on scripted episodes: the model's text goes through the real
path (the actor's OpenAI-compatible server parses hermes `<tool_call>` blocks, verifiers v1
intercepts every call into its trace, the harness runs `calc`, the task's `@vf.reward`s score the
trace). Only the policy is scripted: a correct call and a correct answer earn the full 1.5."""

import pytest

from rlcore.engine.base import Generation, RolloutEngine, SamplingParams
from rlcore.envs.catalog import build_env
from rlcore.envs.tool_use import calculate
from rlcore.envs.vf_calculator import call_text
from rlcore.models.build import build_tokenizer
from rlcore.plan.compose import compose


class ScriptedPolicy(RolloutEngine):
    """Replies `first(expr)` to the task's prompt and `second(expr)` once the prompt holds the
    tool's result (the calculator's reply turn), as token ids of the real tokenizer."""

    def __init__(self, tok, first, second):
        self.tok, self.first, self.second = tok, first, second
        self.prompts: list[str] = []

    @classmethod
    def from_config(cls, options, model, *, seed=0, tokenizer=None, device="cpu"):
        raise TypeError("a scripted policy is built by the test, never from a config")

    def generate(self, prompts, params, images=None):
        out = []
        for ids in prompts:
            text = self.tok.decode(ids)
            self.prompts.append(text)
            expr = text.split("u:", 1)[1].split("=", 1)[0]
            reply = self.second(expr) if "<tool_call>" in text else self.first(expr)
            token_ids = self.tok(reply, add_special_tokens=False).input_ids + [self.tok.eos_token_id]
            out.append(Generation(token_ids, [-1.0] * len(token_ids), [0] * len(token_ids), "stop"))
        return out

    def score(self, prompt_ids, completion_ids):
        return [-1.0] * len(completion_ids)

    def load_weights(self, named_tensors):
        pass

    def set_version(self, version):
        self.policy_version = version

    def state_dict(self):
        return {}


def swapped(expr: str) -> str:
    a, b = expr.split("*")
    return f"{b}*{a}"


@pytest.fixture(scope="module")
def calculator():
    cfg = compose(["+recipe=vf_calculator"])
    env = build_env(cfg.env)
    yield env, build_tokenizer(cfg.model)
    env.close()


@pytest.mark.parametrize(
    "first, second, reward",
    [
        (call_text, calculate, 1.5),  # the demonstration's behaviour
        (lambda e: call_text(swapped(e)), calculate, 1.0),  # same product, expression not copied
        (call_text, lambda e: str(int(calculate(e)) + 1), 0.5),  # copied the call, wrong answer
        (lambda e: calculate(e), lambda e: "", 1.0),  # answered in the head, no tool
    ],
)
def test_scripted_episode_reward(calculator, first, second, reward):
    env, tok = calculator
    policy = ScriptedPolicy(tok, first, second)
    task = env.make_task(0, "train")
    [group] = env.run_groups([task], 2, policy, tok, SamplingParams(max_new_tokens=96))
    for s in group.samples:
        assert not s.failed and s.error is None, s.error
        assert s.reward == reward
    if first is call_text:  # two turns: the tool's result is in the sample, masked
        expr = task.messages[0]["content"].rstrip("=")
        assert any(f"t:{calculate(expr)}" in p for p in policy.prompts)
        assert all(0 in s.loss_mask for s in group.samples)
