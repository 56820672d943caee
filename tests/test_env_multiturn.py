"""Multi-turn episodes through the real HFEngine (tiny random model): token-id exactness."""

import pytest

from rlcore.engine.base import SamplingParams
from rlcore.engine.hf_engine import HFEngine
from rlcore.envs import make_env
from rlcore.models.build import build_model, build_tokenizer
from rlcore.models.render import TurnRenderer, env_turn_text

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class Recording:
    """The real engine, with every batch of prompts it was given kept for inspection."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []

    def generate(self, prompts, params):
        gens = self.engine.generate(prompts, params)
        self.calls.append([(list(p), g) for p, g in zip(prompts, gens)])
        return gens


@pytest.fixture(scope="module")
def setup():
    from rlcore.plan.compose import compose

    cfg = compose(["+recipe=alphabet_sort"])
    tok = build_tokenizer(cfg.model)
    engine = HFEngine(build_model(cfg.model, tok), tok.pad_token_id, tok.eos_token_id, seed=0)
    engine.set_version(5)
    return cfg, tok, engine


def _check_episode_tokens(sample):
    n = len(sample.completion_ids)
    assert len(sample.logprobs) == len(sample.versions) == len(sample.loss_mask) == n
    for lp, v, m in zip(sample.logprobs, sample.versions, sample.loss_mask):
        if m:
            assert v == 5
        else:
            assert lp == 0.0 and v == -1


@pytest.mark.parametrize("template", ["char", "chatml"])
def test_turns_extend_previous_ids_exactly(setup, template):
    cfg, tok, engine = setup
    if template == "chatml":
        tok = build_tokenizer(cfg.model)
        tok.chat_template = CHATML
    env = make_env("alphabet_sort", {"turns": 3, "first_words": 2, "words_per_turn": 1}, seed=0)
    rec = Recording(engine)
    tasks = [env.make_task(i, "train") for i in range(2)]
    groups = env.run_groups(tasks, 3, rec, tok, SamplingParams(max_new_tokens=8))
    assert len(rec.calls) == 3 and all(len(c) == 6 for c in rec.calls)  # batched over the group
    samples = [s for g in groups for s in g.samples]
    for i, sample in enumerate(samples):
        full = sample.prompt_ids + sample.completion_ids
        assert rec.calls[0][i][0] == sample.prompt_ids
        for turn in range(3):
            prompt, gen = rec.calls[turn][i]
            # every turn's prompt and sampled ids are a prefix of the final sequence, in place
            assert full[: len(prompt) + len(gen.token_ids)] == prompt + gen.token_ids
            if turn:
                prev_prompt, prev_gen = rec.calls[turn - 1][i]
                assert prompt[: len(prev_prompt) + len(prev_gen.token_ids)] == prev_prompt + prev_gen.token_ids
                env_ids = prompt[len(prev_prompt) + len(prev_gen.token_ids) :]
                start = len(prev_prompt) + len(prev_gen.token_ids) - len(sample.prompt_ids)
                assert sample.loss_mask[start : start + len(env_ids)] == [0] * len(env_ids)
                text = tok.decode(env_ids)
                assert f"Add: {tasks[i // 3].info['rounds'][turn][0]}" in text
        _check_episode_tokens(sample)
        assert sum(sample.loss_mask) == sum(len(rec.calls[t][i][1].token_ids) for t in range(3))
        assert not sample.failed and 0.0 <= sample.reward <= 1.0


def test_env_delta_matches_template(setup):
    _, tok, _ = setup
    tok.chat_template = CHATML
    msgs = [{"role": "user", "content": "Add: fig"}]
    assert env_turn_text(tok, msgs) == "\n<|im_start|>user\nAdd: fig<|im_end|>\n<|im_start|>assistant\n"
    r = TurnRenderer(tok)
    with_eos = r.continuation([5, tok.eos_token_id], msgs)
    without = r.continuation([5, 6], msgs)  # hit the length cap: the turn is closed for it
    assert without == [tok.eos_token_id] + with_eos


def test_episode_budget_stops_turns(setup):
    cfg, tok, engine = setup
    env = make_env("alphabet_sort", {"turns": 3, "max_episode_tokens": 40}, seed=0)
    rec = Recording(engine)
    groups = env.run_groups([env.make_task(0, "train")], 2, rec, tok, SamplingParams(max_new_tokens=8))
    assert len(rec.calls) == 1  # no room for a second turn within 40 tokens
    assert all(s.finish_reason == "length" for s in groups[0].samples)


def test_builtin_multiturn_envs_run_with_the_engine(setup):
    cfg, tok, engine = setup
    for name, args in [
        ("wordle", {"max_turns": 2}),
        ("tool_use", {"max_turns": 2}),
        ("mini_swe", {"max_turns": 2}),
        ("math", {}),
        ("reverse_text", {}),
    ]:
        env = make_env(name, args, seed=0)
        groups = env.run_groups([env.make_task(0, "train")], 2, engine, tok, SamplingParams(max_new_tokens=6))
        for s in groups[0].samples:
            _check_episode_tokens(s)
            assert not s.failed, (name, s.error)


def test_each_turn_samples_with_its_own_seed(setup):
    """A seeded request must not replay the same random draws every turn."""
    cfg, tok, engine = setup
    env = make_env("wordle", {"max_turns": 3}, seed=0)
    seeds = []

    class SeedRecording(Recording):
        def generate(self, prompts, params):
            seeds.append(params.seed)
            return super().generate(prompts, params)

    env.run_groups(
        [env.make_task(0, "train")], 2, SeedRecording(engine), tok, SamplingParams(max_new_tokens=8, seed=11)
    )
    assert len(seeds) >= 2 and len(set(seeds)) == len(seeds) and seeds[0] == 11
