"""Advantage estimators and reward shaping against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from rlcore.algo.advantages import (
    compute_advantages,
    grpo_advantages,
    linear_length_penalty,
    nonzero_advantage_groups,
    overlong_penalty,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
)
from rlcore.config import AlgoConfig


def close(actual: torch.Tensor, expected: list, atol: float = 1e-5) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype), atol=atol, rtol=0)


def test_grpo_mean_and_std():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0]])
    # mean 0.5, population std 0.5
    close(grpo_advantages(r), [[1.0, -1.0, -1.0, 1.0]])
    close(grpo_advantages(r, std_normalize=False), [[0.5, -0.5, -0.5, 0.5]])


def test_rloo_leave_one_out_baseline():
    r = torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 6.0]])
    # baselines: (2+3)/2, (1+3)/2, (1+2)/2 and (0+6)/2, (0+6)/2, (0+0)/2
    close(rloo_advantages(r), [[-1.5, 0.0, 1.5], [-3.0, -3.0, 6.0]])


def test_rloo_needs_two_samples():
    with pytest.raises(ValueError, match="at least 2"):
        rloo_advantages(torch.tensor([[1.0], [2.0]]))


def test_reinforce_pp_baseline_uses_batch_std():
    r = torch.tensor([[1.0, 0.0], [3.0, 3.0], [0.0, 2.0]])
    # centred: [.5, -.5], [0, 0], [-1, 1]; batch mean 0; population var (4 * .25... ) = 2.5 / 6
    std = math.sqrt(2.5 / 6)
    close(
        reinforce_pp_baseline_advantages(r),
        [[0.5 / std, -0.5 / std], [0.0, 0.0], [-1.0 / std, 1.0 / std]],
    )
    # unlike GRPO, the low-spread group [1, 0] is not blown up to +-1
    close(grpo_advantages(r)[0], [1.0, -1.0])


@pytest.mark.parametrize("name", ["grpo", "rloo", "reinforce_pp_baseline"])
def test_all_equal_rewards_give_zero_advantages(name):
    # 0.1 and 1/3 are not exact in binary: a naive mean leaves ~1e-8 residues
    r = torch.tensor([[0.1] * 10, [0.7] * 10, [1 / 3] * 10, [1.0] * 10])
    adv = compute_advantages(r, AlgoConfig(name=name))
    assert torch.equal(adv, torch.zeros_like(adv))


@pytest.mark.parametrize("name", ["grpo", "rloo", "reinforce_pp_baseline"])
def test_advantages_sum_to_zero_per_group(name):
    r = torch.tensor([[1.0, 0.0, 0.5, 0.25], [0.0, 0.0, 1.0, 0.0]])
    adv = compute_advantages(r, AlgoConfig(name=name))
    close(adv.sum(dim=1), [0.0, 0.0])


def test_integer_rewards_are_accepted():
    adv = compute_advantages(torch.tensor([[1, 0]]), AlgoConfig(std_normalize=False))
    close(adv, [[0.5, -0.5]])


def test_unknown_estimator():
    with pytest.raises(ValueError, match="algo.name"):
        compute_advantages(torch.zeros(1, 2), AlgoConfig(name="ppo"))


def test_overlong_penalty_ramp():
    lengths = torch.tensor([5, 6, 7, 8, 10, 12])
    # L_max 10, L_cache 4: zero up to 6, then -1/4 per token, -1 from 10 on
    close(overlong_penalty(lengths, max_tokens=10, buffer_tokens=4), [0.0, 0.0, -0.25, -0.5, -1.0, -1.0])
    close(overlong_penalty(lengths, 10, 4, penalty=0.5), [0.0, 0.0, -0.125, -0.25, -0.5, -0.5])


def test_linear_length_penalty():
    close(linear_length_penalty(torch.tensor([0, 10, 25]), per_token=0.01), [0.0, -0.1, -0.25])


def test_overlong_penalty_shapes_rewards_before_the_baseline():
    cfg = AlgoConfig(length_penalty="overlong", overlong_max_tokens=10, overlong_buffer_tokens=4)
    r = torch.tensor([[1.0, 1.0]])
    # both correct, but the second hit the cap: shaped rewards [1, 0] -> GRPO [1, -1]
    close(compute_advantages(r, cfg, lengths=torch.tensor([[4, 10]])), [[1.0, -1.0]])
    with pytest.raises(ValueError, match="lengths"):
        compute_advantages(r, cfg)


def test_linear_penalty_with_rloo():
    cfg = AlgoConfig(name="rloo", length_penalty="linear", length_penalty_per_token=0.01)
    # shaped rewards [-0.1, -0.2]: each sample's baseline is the other's reward
    adv = compute_advantages(torch.tensor([[0.0, 0.0]]), cfg, lengths=torch.tensor([[10, 20]]))
    close(adv, [[0.1, -0.1]])


def test_lengths_ignored_without_penalty():
    adv = compute_advantages(torch.tensor([[1.0, 0.0]]), AlgoConfig(), lengths=torch.tensor([[1000, 1]]))
    close(adv, [[1.0, -1.0]])


def test_nonzero_advantage_groups():
    r = torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0], [0.5, 0.5, 0.5], [0.0, 1e-9, 0.0]])
    assert nonzero_advantage_groups(r).tolist() == [False, True, False, True]
    assert nonzero_advantage_groups(r, atol=1e-6).tolist() == [False, True, False, False]
