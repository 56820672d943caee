from rlcore.envs import make_env
from rlcore.envs.reverse_text import lcs_length, lcs_ratio


def test_lcs():
    assert lcs_length("abcde", "ace") == 3
    assert lcs_length("", "abc") == 0
    assert lcs_ratio("cba", "cba") == 1.0
    assert lcs_ratio("cbaxx", "cba") == 3 / 5
    assert lcs_ratio("", "") == 1.0


def test_tasks_are_deterministic_and_split():
    env = make_env("reverse_text", {"alphabet": "ab", "min_len": 2, "max_len": 4}, seed=1)
    t1, t2 = env.make_task(5, "train"), env.make_task(5, "train")
    assert t1 == t2 and t1.answer == t1.messages[0]["content"][::-1]
    assert env.reward(t1, t1.answer) == 1.0
    assert {env.make_task(i, "eval").id.split("/")[1] for i in range(3)} == {"eval"}
