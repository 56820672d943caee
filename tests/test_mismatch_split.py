"""The two parts of the engine/trainer mismatch: `engine_mismatch_kl` on tokens the trainer scores
with the weights that sampled them, `staleness_kl` on tokens of an older version (hand-computed)."""

from __future__ import annotations

import math

import pytest
import torch

from rlcore.algo.losses import LossInputs, policy_loss
from rlcore.batch.step import RankWork, rank_sample_versions
from rlcore.config import AlgoConfig
from rlcore.trainer.core import step_metrics
from rlcore.types import Sample

LN = math.log


def k3(rho: float) -> float:
    return rho - 1 - LN(rho)


def test_the_loss_metrics_split_the_mismatch_by_version():
    # rho = old / behaviour = [1.1, 2, 0.5, 9]; token 3 is off the loss mask; tokens 0 and 2 fresh
    logp = torch.tensor([-1.0, -1.0, -1.0, -1.0])
    behaviour = logp - torch.tensor([LN(1.1), LN(2.0), LN(0.5), LN(9.0)])
    inp = LossInputs(
        logp,
        behaviour,
        torch.ones(4),
        torch.tensor([1.0, 1.0, 1.0, 0.0]),
        same_version=torch.tensor([True, False, True, True]),
    )
    _, m = policy_loss(inp, AlgoConfig(), 3.0)
    assert m["engine_mismatch_kl_sum"].item() == pytest.approx(k3(1.1) + k3(0.5), abs=1e-5)
    assert m["staleness_kl_sum"].item() == pytest.approx(k3(2.0), abs=1e-5)
    assert m["same_version_frac"].item() == 2.0
    assert m["mismatch_kl_sum"].item() == pytest.approx(k3(1.1) + k3(2.0) + k3(0.5), abs=1e-5)
    _, plain = policy_loss(LossInputs(logp, behaviour, torch.ones(4), torch.ones(4)), AlgoConfig(), 3.0)
    assert "engine_mismatch_kl_sum" not in plain and "staleness_kl_sum" not in plain


def test_step_metrics_average_each_part_over_its_own_tokens():
    totals = {
        "loss": 0.1,
        "entropy": 8.0,
        "tokens": 20.0,
        "loss_tokens": 8.0,
        "mismatch_kl_sum": 4.0,
        "engine_mismatch_kl_sum": 0.03,
        "staleness_kl_sum": 3.97,
        "same_version_frac": 3.0,
    }
    out = step_metrics(totals, {}, 1.0, 0.5)
    assert out["engine_mismatch_kl"] == pytest.approx(0.01)  # 0.03 over the 3 fresh tokens
    assert out["staleness_kl"] == pytest.approx(3.97 / 5)  # over the 5 stale ones
    assert out["mismatch_kl"] == pytest.approx(0.5) and out["same_version_frac"] == pytest.approx(3 / 8)
    assert "engine_mismatch_kl_sum" in totals  # the caller's dict is left alone
    # a step with no fresh token measures no engine mismatch: the key is absent, not 0
    none_fresh = step_metrics({**totals, "same_version_frac": 0.0}, {}, 1.0, 0.5)
    assert "engine_mismatch_kl" not in none_fresh and none_fresh["staleness_kl"] == pytest.approx(3.97 / 8)


def test_rank_sample_versions_follow_the_bins():
    def sample(versions):
        return Sample([1], [2] * len(versions), [0.0] * len(versions), versions, [1] * len(versions))

    data = [[sample([3, 3]), sample([2, 3])], [sample([3])]]
    work = RankWork(data=["a", "b"], picks=[(0, 1), (1, 0), (0, 0)], advantages=[0.0] * 3, bins=[[2, 0], [], [1]])
    got = rank_sample_versions(work, data)
    assert [t.tolist() for t in got] == [[3, 2], [-1], [3]]  # a sample's oldest token counts
