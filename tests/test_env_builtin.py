"""Builtin environments: deterministic tasks, eval splits, rewards on hand-written episodes."""

import pytest

from rlcore.envs import make_env, registered
from rlcore.envs.answers import equivalent, extract_final
from rlcore.envs.tool_use import calculate
from rlcore.envs.tools import ToolCall, parse_answer, parse_tool_calls
from rlcore.envs.wordle import feedback, parse_guess

BUILTIN = ["reverse_text", "alphabet_sort", "math", "wordle", "tool_use", "mini_swe"]


def user(text):
    return {"role": "user", "content": text}


def bot(text):
    return {"role": "assistant", "content": text}


@pytest.mark.parametrize("name", BUILTIN)
def test_registered_deterministic_with_eval_split(name):
    assert name in registered()
    a, b = make_env(name, {}, seed=3), make_env(name, {}, seed=3)
    assert a.make_task(7, "train") == b.make_task(7, "train")
    assert a.eval_size >= 1
    evals = a.eval_tasks()
    assert len(evals) == a.eval_size and all("/eval/" in t.id for t in evals)
    assert len({t.id for t in evals}) == len(evals)


def test_alphabet_sort_reward():
    env = make_env("alphabet_sort", {"turns": 2, "first_words": 3}, seed=0)
    t = env.make_task(0, "train")
    first, second = t.answer
    good = [*t.messages, bot(" ".join(first)), user("Add: ..."), bot(", ".join(second))]
    assert env.score(t, good, {}) == 1.0
    half = [*t.messages, bot(" ".join(first))]
    assert env.score(t, half, {}) == 0.5
    assert env.score(t, [*t.messages, bot(" ".join(reversed(first)))], {}) < 0.5
    msgs, done = env.env_response(t, half, {})
    assert not done and msgs[0]["content"] == "Add: " + " ".join(t.info["rounds"][1])
    assert env.env_response(t, good, {}) == ([], True)


def test_math_reward_and_extraction():
    env = make_env("math", {}, seed=0)
    t = env.make_task(0, "train")
    assert env.reward(t, f"blah\n#### {t.answer}") == 1.0
    assert env.reward(t, f"\\boxed{{{t.answer}}}") == 1.0
    assert env.reward(t, f"#### {int(t.answer) + 1}") == 0.0
    assert env.reward(t, "no idea") == 0.0
    assert extract_final("x #### 12") == "12" and equivalent("1,200.0", "1200") and equivalent("\\frac{3}{4}", "0.75")
    assert env.eval_size == 64 and make_env("math", {"eval_size": 1000}, 0).eval_size == 100
    with pytest.raises(ValueError, match="env.args.path"):
        make_env("math", {"path": "/nonexistent.jsonl"}, 0)


def test_wordle_game():
    assert feedback("crane", "crate") == "GGG-G" and feedback("speed", "abide") == "--Y-Y"
    assert parse_guess("I guess CRANE now") == "crane" and parse_guess("hmm") is None
    env = make_env("wordle", {}, seed=0)
    t = env.make_task(0, "train")
    wrong = "zzzzz" if t.answer != "zzzzz" else "aaaaa"
    hist = [*t.messages, bot(wrong)]
    msgs, done = env.env_response(t, hist, {})
    assert not done and msgs[0]["content"] == f"{wrong} {feedback(wrong, t.answer)}"
    assert env.env_response(t, [*t.messages, bot("??")], {})[0][0]["content"].startswith("Invalid")
    assert env.env_response(t, [*t.messages, bot(t.answer)], {}) == ([], True)
    assert env.score(t, [*t.messages, bot(t.answer)], {}) == 1.0
    assert env.score(t, [*hist, msgs[0], bot(t.answer)], {}) == pytest.approx(0.9)
    assert env.score(t, hist, {}) < 0.1


def test_tool_parsing_and_calculator():
    text = "<tool>search: Kalo town</tool> then <tool>calc: 2*(3+4)</tool><answer> 14 </answer>"
    assert parse_tool_calls(text) == [ToolCall("search", "Kalo town"), ToolCall("calc", "2*(3+4)")]
    assert parse_answer(text) == "14"
    assert calculate("2*(3+4)") == "14" and calculate("10/4") == "2.5"
    for bad in ["__import__('os')", "2**10**10", "x+1"]:
        with pytest.raises(ValueError):
            calculate(bad)


def test_tool_use_scripted_episode():
    env = make_env("tool_use", {}, seed=0)
    t = env.make_task(1, "train")
    a, b = t.info["towns"]
    hist = [*t.messages, bot(f"<tool>search: {a}</tool><tool>search: {b}</tool>")]
    state = {}
    msgs, done = env.env_response(t, hist, state)
    assert not done and a in msgs[0]["content"] and b in msgs[0]["content"] and state["tool_calls"] == 2
    hist += [*msgs, bot("<tool>calc: 1/0</tool>")]
    msgs, _ = env.env_response(t, hist, state)
    assert "error: ZeroDivisionError" in msgs[0]["content"]  # tool errors are feedback, not faults
    assert env.env_response(t, [*hist, bot("<tool>nope: x</tool>")], state)[0][0]["content"].count("unknown tool") == 1
    good = [*hist, bot(f"<answer>{t.answer}</answer>")]
    assert env.env_response(t, good, state) == ([], True)
    assert env.score(t, good, state) == 1.0
    assert env.score(t, [*hist, bot("<answer>0</answer>")], state) == 0.0


def test_mini_swe_scripted_fix():
    from rlcore.envs.mini_swe import FUNCTIONS

    env = make_env("mini_swe", {"functions": 2, "bugs": 1}, seed=0)
    t = env.make_task(0, "train")
    state = env.init_state(t)
    before = env.score(t, [], state)
    assert 0.0 <= before < 1.0  # one of two functions broken
    hist = [*t.messages, bot("<tool>read: lib.py</tool>")]
    msgs, _ = env.env_response(t, hist, state)
    assert "def " in msgs[0]["content"]
    fixed = "\n\n".join(good for name, good, _, _ in FUNCTIONS if f"def {name}(" in state["files"]["lib.py"])
    hist += [*msgs, bot(f"<tool>write: lib.py\n{fixed}</tool><tool>run: tests</tool>")]
    msgs, _ = env.env_response(t, hist, state)
    assert "4/4 passed" in msgs[0]["content"]
    assert env.score(t, hist, state) == 1.0
    # editing the tests does not help: scoring restores them
    cheat = {"files": {**t.info["files"], "test_lib.py": "def test_ok():\n    pass\n"}}
    assert env.env_response(t, [bot("<tool>write: test_lib.py\nx</tool>")], cheat)[0][0]["content"].startswith(
        "<result>write: error"
    )
    assert env.score(t, [], cheat) == before


@pytest.mark.parametrize(
    "name,key,value",
    [
        ("alphabet_sort", "turns", 0),
        ("wordle", "words", "abc"),
        ("tool_use", "search_k", 0),
        ("mini_swe", "bugs", 5),
        ("alphabet_sort", "max_turns", 0),
    ],
)
def test_bad_args_name_the_key(name, key, value):
    with pytest.raises(ValueError, match=f"env.args.{key}"):
        make_env(name, {key: value}, 0)
