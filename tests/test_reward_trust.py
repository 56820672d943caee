"""Where reward calls run when `env.reward.isolation` is unset: rlcore's own string rewards
(`trusted_reward = True` in the class's own body) in threads, every other environment, a
subclass of a trusted one included, in the reward workers."""

from __future__ import annotations

import pytest

from rlcore.config import RewardRuntimeConfig
from rlcore.envs.alphabet_sort import AlphabetSort
from rlcore.envs.base import Environment
from rlcore.envs.math_env import MathWordProblems
from rlcore.envs.reverse_text import ReverseText
from rlcore.envs.shape_count import ShapeCount
from rlcore.envs.wordle import Wordle
from rlcore.types import Task


class PatchedReverseText(ReverseText):
    """A user's environment built on a trusted one, with a reward of its own."""

    def reward(self, task: Task, completion: str) -> float:
        return 1.0


class Untouched(ReverseText):
    """A subclass that changes nothing: still not trusted unless it says so."""


@pytest.mark.parametrize("cls", [ReverseText, AlphabetSort, Wordle, ShapeCount])
def test_rlcores_own_string_rewards_run_in_threads_when_unset(cls):
    assert cls().reward_runtime.isolation == "thread"


@pytest.mark.parametrize("cls", [PatchedReverseText, Untouched, MathWordProblems])
def test_every_other_environment_runs_its_rewards_in_workers_when_unset(cls):
    assert cls().reward_runtime.isolation == "worker"


def test_a_set_isolation_wins_over_the_environments_default():
    assert ReverseText(reward_runtime=RewardRuntimeConfig(isolation="worker")).reward_runtime.isolation == "worker"
    assert PatchedReverseText(reward_runtime=RewardRuntimeConfig(isolation="thread")).reward_runtime.isolation == (
        "thread"
    )


def test_trust_is_read_from_the_declaring_class_only():
    assert Environment.reward_isolation_default() == "worker"
    assert ReverseText.reward_isolation_default() == "thread"
    assert Untouched.trusted_reward is True  # inherited as an attribute...
    assert Untouched.reward_isolation_default() == "worker"  # ...but not as trust


def test_a_requests_calls_are_spread_over_env_reward_workers():
    import os

    env = PatchedReverseText(reward_runtime=RewardRuntimeConfig(workers=7))
    unset = PatchedReverseText()
    try:
        assert env.reward_pool().size == 7
        assert unset.reward_pool().size == max(2, min(4, os.cpu_count() or 1))
    finally:
        env.reward_pool().close()
        unset.reward_pool().close()
