"""Builtin recipes can learn on CPU (issue 21 item 7): warm-up data for the multi-turn
environments, and warm-up settings that belong to recipes, not environments."""

from pathlib import Path

import pytest
import yaml

from rlcore.envs import make_env
from rlcore.models.build import build_tokenizer
from rlcore.run import compose, recipes
from rlcore.sft import build_dataset
from rlcore.validate import ConfigError, validate

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("env_file", sorted((REPO / "conf" / "env").glob("*.yaml")), ids=lambda p: p.stem)
def test_choosing_an_environment_sets_only_the_environment(env_file):
    assert set(yaml.safe_load(env_file.read_text())) <= {"name", "seed", "args"}
    assert compose([f"env={env_file.stem}"]).sft == compose([]).sft


@pytest.mark.parametrize("recipe", [r for r in recipes() if r not in ("reverse_text", "reverse_text_sft")])
def test_each_rl_recipe_sets_its_own_warm_up(recipe):
    """A recipe states its warm-up (0 or a number) instead of inheriting the default job's."""
    sft = yaml.safe_load((REPO / "recipes" / f"{recipe}.yaml").read_text()).get("sft") or {}
    assert "warmup_steps" in sft, recipe


@pytest.mark.parametrize("name,args", [("alphabet_sort", {}), ("tool_use", {"search_k": 1})])
def test_multi_turn_demonstrations_are_whole_winning_episodes(name, args):
    env = make_env(name, args, 0)
    for i in range(50):
        task = env.make_task(i, "demo")
        conv = env.demonstration_messages(task)
        assert sum(m["role"] == "assistant" for m in conv) >= 2  # every turn, not just the first
        assert len([m for m in conv if m["role"] == "assistant"]) <= env.max_turns
        assert env.score(task, conv, env.init_state(task)) == 1.0


@pytest.mark.parametrize("recipe", ["alphabet_sort", "tool_use"])
def test_recipe_warm_up_data_builds_and_fits(recipe):
    cfg = compose([f"+recipe={recipe}", "sft.num_examples=16"])
    assert cfg.sft.warmup_steps > 0 and cfg.sft.dataset == "env"
    data = build_dataset(cfg, build_tokenizer(cfg.model))
    assert len(data.samples) == 16 and not data.skipped
    for s in data.samples:
        # only the policy's turns are trained on; the environment's replies are context
        assert 0 < sum(s.loss_mask) < len(s.completion_ids)
        assert len(s.prompt_ids) + len(s.completion_ids) <= cfg.env.args["max_episode_tokens"]


def test_warm_up_without_demonstrations_is_refused_before_ray():
    """The default job's warm-up kept with an environment that has no demonstrations: one line
    naming the key, before anything starts (not a failure after Ray and the models are up)."""
    with pytest.raises(ConfigError) as err:
        validate(compose(["env=mini_swe"]))
    assert err.value.key == "sft.warmup_steps" and "set sft.warmup_steps=0" in str(err.value)
    validate(compose(["env=mini_swe", "sft.warmup_steps=0"]))
    validate(compose(["+recipe=mini_swe"]))
    validate(compose(["+recipe=alphabet_sort"]))
