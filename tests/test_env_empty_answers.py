"""Empty answers are answers (issue 22): a policy that collapses to end-of-sequence at once gets
its environment's (low) reward on every sample; no sample is failed, so the negative signal
reaches the trainer. The engine is the real HFEngine over the tiny model, its logits pushed to
end-of-sequence by a forward hook (what a collapsed policy does)."""

import math

import pytest
import torch

from rlcore.engine.base import SamplingParams
from rlcore.engine.hf_engine import HFEngine
from rlcore.envs import make_env
from rlcore.models.build import build_model, build_tokenizer
from tests.test_env_builtin import BUILTIN


def collapsed_engine():
    """A real engine whose policy always answers end-of-sequence first."""
    from rlcore.plan.compose import compose

    cfg = compose([])
    tok = build_tokenizer(cfg.model)
    torch.manual_seed(0)
    model = build_model(cfg.model, tok)

    def to_eos(module, args, output):
        output.logits[..., tok.eos_token_id] += 1e4
        return output

    model.register_forward_hook(to_eos)
    return HFEngine(model, tok.pad_token_id, tok.eos_token_id, seed=0), tok


@pytest.fixture(scope="module")
def engine_tok():
    return collapsed_engine()


@pytest.mark.parametrize("name", BUILTIN)
def test_builtin_envs_score_empty_answers(engine_tok, name):
    engine, tok = engine_tok
    env = make_env(name, {}, seed=0)
    groups = env.run_groups(
        [env.make_task(i, "train") for i in range(2)], 2, engine, tok, SamplingParams(max_new_tokens=8)
    )
    samples = [s for g in groups for s in g.samples]
    assert all(s.completion_ids[:1] == [tok.eos_token_id] for s in samples)  # the policy said nothing
    assert all(not s.failed and s.error is None for s in samples), [s.error for s in samples]
    for g in groups:  # the reward the environment gives an empty answer (its rubric decides)
        state = env.init_state(g.task) if hasattr(env, "init_state") else {}
        empty = env.score(g.task, [*g.task.messages, {"role": "assistant", "content": ""}], state)
        assert all(math.isfinite(s.reward) and s.reward == empty for s in g.samples)


# verifiers environments: tests/test_verifiers_env.py::test_v1_env_empty_reply_is_scored
