"""Builtin recipes can learn on CPU (issue 21 item 7): warm-up data for the multi-turn
environments, and warm-up settings that belong to recipes, not environments."""

import json
import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
import yaml

from rlcore.config.errors import ConfigError
from rlcore.envs import make_env
from rlcore.envs.reverse_text import ReverseText
from rlcore.envs.wordle import feedback
from rlcore.models.build import build_tokenizer
from rlcore.plan.compose import compose, recipes
from rlcore.plan.validate import validate
from rlcore.sft.dataset import build_dataset
from tests.ranks import leave_rank

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("env_file", sorted((REPO / "conf" / "env").glob("*.yaml")), ids=lambda p: p.stem)
def test_choosing_an_environment_sets_only_the_environment(env_file):
    assert set(yaml.safe_load(env_file.read_text())) <= {"name", "seed", "args", "reward"}  # the `env` section alone
    assert compose([f"env={env_file.stem}"]).sft == compose([]).sft


@pytest.mark.parametrize("recipe", [r for r in recipes() if r not in ("reverse_text", "reverse_text_sft")])
def test_each_rl_recipe_sets_its_own_warm_up(recipe):
    """A recipe states its warm-up (0 or a number) instead of inheriting the default job's."""
    sft = yaml.safe_load((REPO / "recipes" / f"{recipe}.yaml").read_text()).get("sft") or {}
    assert "warmup_steps" in sft, recipe


@pytest.mark.parametrize(
    "name,args", [("alphabet_sort", {}), ("tool_use", {"search_k": 1}), ("tool_use", {"facts": 1})]
)
def test_multi_turn_demonstrations_are_whole_winning_episodes(name, args):
    env = make_env(name, args, 0)
    for i in range(50):
        task = env.make_task(i, "demo")
        conv = env.demonstration_messages(task)
        assert sum(m["role"] == "assistant" for m in conv) >= 2  # every turn, not just the first
        assert len([m for m in conv if m["role"] == "assistant"]) <= env.max_turns
        assert env.score(task, conv, env.init_state(task)) == 1.0


def test_wordle_solver_demonstrations_win_with_valid_consistent_guesses():
    """The solver's games (wordle's warm-up data) are won inside the turn limit (all over the
    recipe's short list; nearly all over the full list, where `-ight` words can outlast 6 guesses),
    every guess is a listed word agreeing with all earlier marks, and the environment's own
    reward pays them."""
    for args, min_wins in (({}, 95), ({"words": compose(["+recipe=wordle"]).env.args["words"]}, 100)):
        env, wins = make_env("wordle", args, 0), 0
        for i in range(100):
            task = env.make_task(i, "demo")
            guesses = env.demonstration_turns(task)
            assert len(guesses) <= env.max_turns
            if guesses[-1] != task.answer:
                assert len(guesses) == env.max_turns
                continue
            wins += 1
            for k, g in enumerate(guesses):
                assert g in env.words
                assert all(feedback(p, g) == feedback(p, task.answer) for p in guesses[:k])
            conv = env.demonstration_messages(task)
            assert [m["content"] for m in conv if m["role"] == "assistant"] == guesses
            assert env.score(task, conv, {}) == pytest.approx(1.0 - 0.1 * (len(guesses) - 1))
        assert wins >= min_wins


def test_noisy_wordle_demonstrations_are_weaker_games_of_listed_words():
    """`demo_noise` (the wordle recipe's warm-up): some guesses repeat the previous one, so the
    demonstrator scores clearly below the solver (RL has room above it); the games are the same
    each time they are built, and apart from the repeats they are the solver's games."""
    words = compose(["+recipe=wordle"]).env.args["words"]
    noise = compose(["+recipe=wordle"]).env.args["demo_noise"]
    assert 0 < noise < 1
    solver = make_env("wordle", {"words": words}, 0)
    noisy = make_env("wordle", {"words": words, "demo_noise": noise}, 0)
    totals = {"solver": 0.0, "noisy": 0.0}
    repeated = 0
    for i in range(200):
        task = noisy.make_task(i, "demo")
        guesses = noisy.demonstration_turns(task)
        assert guesses == noisy.demonstration_turns(task) and all(g in noisy.words for g in guesses)
        repeats = [k for k in range(1, len(guesses)) if guesses[k] == guesses[k - 1]]
        repeated += bool(repeats)
        distinct = [g for k, g in enumerate(guesses) if k not in repeats]
        assert distinct == solver.demonstration_turns(task)[: len(distinct)]
        conv = noisy.demonstration_messages(task)
        totals["noisy"] += noisy.score(task, conv, {})
        totals["solver"] += solver.score(task, solver.demonstration_messages(task), {})
    assert totals["solver"] / 200 > 0.85 and totals["noisy"] / 200 < totals["solver"] / 200 - 0.05
    assert repeated > 20  # the wasted turns RL is left to unlearn
    with pytest.raises(ValueError, match="env.args.demo_noise"):
        make_env("wordle", {"demo_noise": 1.5}, 0)


@pytest.mark.parametrize("args", [{"functions": 1}, {"functions": 2, "bugs": 1}, {"functions": 3, "bugs": 2}])
def test_mini_swe_demonstrations_fix_the_repo_in_the_real_sandbox(args):
    """The scripted agent (read, write the correct lib.py, run the tests, stop) wins every task:
    its test run happens in the sandbox and reports all passing, and the environment's own
    reward (the original tests, run in the sandbox against the final files) is 1, up from the
    broken repo's score."""
    env = make_env("mini_swe", args, 0)
    for i in range(8):
        task = env.make_task(i, "demo")
        conv = env.demonstration_messages(task)
        replies = [m["content"] for m in conv if m["role"] == "assistant"]
        assert replies[0] == "<tool>read: lib.py</tool>" and replies[-1] == "done" and len(replies) <= env.max_turns
        results = [m["content"] for m in conv[len(task.messages) :] if m["role"] == "user"]
        assert results[0] == f"<result>read: {task.info['files']['lib.py']}</result>"
        assert "passed; failed: none" in results[-1]
        assert env.score(task, task.messages, env.init_state(task)) < 1.0  # the planted bug breaks a test
        assert replay_score(env, task, replies) == 1.0


def replay_score(env, task, replies):
    """Play `replies` through the environment (state is only what the tools did); its score."""
    state, history = env.init_state(task), list(task.messages)
    for reply in replies:
        history.append({"role": "assistant", "content": reply})
        messages, done = env.env_response(task, history, state)
        if done:
            break
        history.extend(messages)
    assert done
    return env.score(task, history, state)


def test_noisy_mini_swe_demonstrations_leave_some_repos_unfixed():
    """`demo_noise` (the mini_swe recipe's warm-up): the demonstrator writes some repos back as
    it read them (bug kept: the environment scores them as before), fixes the rest (scored 1);
    the same tasks each time, and about the share asked for."""
    args = dict(compose(["+recipe=mini_swe"]).env.args)
    assert 0 < args["demo_noise"] < 1
    env, unfixed = make_env("mini_swe", args, 0), 0
    for i in range(24):
        task = env.make_task(i, "demo")
        turns = env.demonstration_turns(task)
        assert turns == env.demonstration_turns(task)
        kept = turns[1] == f"<tool>write: lib.py\n{task.info['files']['lib.py']}</tool>"
        assert kept or turns[1] == f"<tool>write: lib.py\n{task.info['fixed']}</tool>"
        broken = env.score(task, task.messages, env.init_state(task))
        assert replay_score(env, task, turns) == (broken if kept else 1.0)
        unfixed += kept
    assert 4 <= unfixed <= 20
    with pytest.raises(ValueError, match="env.args.demo_noise"):
        make_env("mini_swe", {"demo_noise": -0.1}, 0)


@pytest.mark.parametrize("path", ["", "math_one_step.jsonl"])
def test_math_demonstrations_are_worked_answers_the_reward_accepts(path):
    env = make_env("math", {"path": path}, 0)
    for i in range(100):
        task = env.make_task(i, "demo" if path else "train")
        reply = env.demonstration(task)
        assert "####" in reply and reply != task.answer and env.reward(task, reply) == 1.0
        assert env.reward(task, reply.replace(f"#### {task.answer}", f"#### {int(task.answer) + 1}")) == 0.0


def test_math_one_step_demo_split_is_apart_from_the_tasks():
    env = make_env("math", {"path": "math_one_step.jsonl"}, 0)
    questions = {s: {r["question"] for r in env.split_rows[s]} for s in ("train", "demo", "eval")}
    assert all(len(q) >= 200 for q in questions.values())
    assert not (questions["demo"] & questions["train"]) and not (
        questions["eval"] & (questions["train"] | questions["demo"])
    )
    assert env.split_size("demo") == len(questions["demo"])


@pytest.mark.parametrize("recipe", ["alphabet_sort", "tool_use", "wordle", "math", "mini_swe"])
def test_recipe_warm_up_data_builds_and_fits(recipe):
    cfg = compose([f"+recipe={recipe}", "sft.num_examples=16"])
    assert cfg.sft.warmup_steps > 0 and cfg.sft.dataset == "env"
    validate(cfg)
    data = build_dataset(cfg, build_tokenizer(cfg.model))
    assert len(data.samples) == 16 and not data.skipped
    for s in data.samples:
        if recipe == "math":  # single turn: the whole reply is trained on
            assert all(s.loss_mask) and len(s.completion_ids) <= cfg.rollout.sampling.max_new_tokens
            continue
        # only the policy's turns are trained on; the environment's replies are context
        assert 0 < sum(s.loss_mask) < len(s.completion_ids)
        assert len(s.prompt_ids) + len(s.completion_ids) <= cfg.env.args["max_episode_tokens"]


class NoDemonstrations(ReverseText):
    """reverse_text without reference replies."""

    def demonstration(self, task):
        return None


def test_warm_up_without_demonstrations_is_refused_before_ray():
    """The default job's warm-up kept with an environment that has no demonstrations: one line
    naming the key, before anything starts (not a failure after Ray and the models are up)."""
    env = f"env.name={__name__}:NoDemonstrations"
    with pytest.raises(ConfigError) as err:
        validate(compose([env]))
    assert err.value.key == "sft.warmup_steps" and "set sft.warmup_steps=0" in str(err.value)
    validate(compose([env, "sft.warmup_steps=0"]))
    validate(compose(["+recipe=mini_swe"]))
    validate(compose(["+recipe=alphabet_sort"]))


def _sft_lr_rank(rank, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from rlcore.batch.packing import pack_for_ranks
    from rlcore.trainer.core import TrainerCore

    cfg = compose(["trainer.lr=0.01", "mode=sft", "sft.num_examples=8"])
    core = TrainerCore(cfg, rank, 1)
    data = build_dataset(cfg, core.tokenizer)
    shards = pack_for_ranks(data.samples, [0.0] * len(data.samples), 1, 4096)
    tokens = sum(int(mb.loss_mask.sum()) for mb in shards[0])

    def params():
        return [t.detach().clone() for _, t in core.full_parameters()]

    before = params()
    core.sft_step(shards[0], tokens, lr=0.0)  # the warm-up's own rate: here none at all
    frozen = all(torch.equal(a, b) for a, b in zip(before, params()))
    lr_after = core.optimizer.param_groups[0]["lr"]  # restored for the next (RL) step
    core.sft_step(shards[0], tokens)
    moved = not all(torch.equal(a, b) for a, b in zip(before, params()))
    torch.save({"frozen": frozen, "lr_after": lr_after, "moved": moved}, out)
    core.shutdown()
    leave_rank()


def test_warm_up_steps_run_at_their_own_learning_rate(tmp_path):
    """A warm-up step's own rate (`sft.lr`, here passed per step): the step uses it; the step
    after uses trainer.lr again (what RL runs at)."""
    from rlcore.trainer.core import free_port

    out = tmp_path / "r.pt"
    mp.start_processes(_sft_lr_rank, args=(free_port(), str(out)), nprocs=1, start_method="spawn")
    r = torch.load(out)
    assert r["frozen"] and r["lr_after"] == pytest.approx(0.01) and r["moved"]


def test_shipped_math_files_are_what_the_generator_writes():
    from rlcore.data import data_path
    from rlcore.data.make_math import FILES

    for name, rows in FILES.items():
        assert data_path(name).read_text() == "".join(json.dumps(r) + "\n" for r in rows()), name
