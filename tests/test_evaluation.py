"""pass@k (unbiased estimator) and the evaluation summary."""

import itertools
import random

import pytest

from rlcore.batch.meta import group_meta
from rlcore.plan.compose import compose
from rlcore.plan.validate import problems
from rlcore.report.evaluation import pass_at_k, summarize
from rlcore.types import Group, Sample, Task


def brute_force(n, c, k):
    """Fraction of k-subsets of n completions (c correct) that contain a correct one."""
    outcomes = [1] * c + [0] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(outcomes[i] for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize(
    "n,c,k", [(1, 0, 1), (1, 1, 1), (5, 2, 1), (5, 2, 3), (6, 1, 5), (8, 0, 8), (8, 3, 8), (10, 7, 4)]
)
def test_pass_at_k_is_the_subset_probability(n, c, k):
    assert pass_at_k(n, c, k) == pytest.approx(brute_force(n, c, k), abs=1e-12)


def test_pass_at_1_is_the_success_rate():
    for n, c in [(4, 1), (16, 9), (100, 37)]:
        assert pass_at_k(n, c, 1) == pytest.approx(c / n)


def test_pass_at_k_rejects_impossible_arguments():
    for n, c, k in [(4, 5, 1), (4, 1, 5), (4, 1, 0)]:
        with pytest.raises(ValueError):
            pass_at_k(n, c, k)


def _group(rewards, failed=()):
    samples = [
        Sample([1], [5, 6], [0.0, 0.0], [3, 4], [1, 1], reward=r, failed=i in failed) for i, r in enumerate(rewards)
    ]
    return group_meta(Group(Task(id="t", messages=[]), samples))


def test_summary_counts_failed_samples_as_incorrect():
    groups = [_group([1.0, 0.2, 1.0, 0.0]), _group([0.5, 1.0, 0.0, 0.0], failed={1})]
    m = summarize(groups, [1, 4], threshold=1.0)
    assert m["eval/pass@1"] == pytest.approx((2 / 4 + 0 / 4) / 2)
    assert m["eval/pass@4"] == pytest.approx((1.0 + 0.0) / 2)
    assert m["eval/reward_mean"] == pytest.approx((1 + 0.2 + 1 + 0 + 0.5 + 0 + 0) / 7)
    assert m["eval/failed_frac"] == pytest.approx(1 / 8)
    assert (m["eval/version_min"], m["eval/version_max"]) == (3, 4)


def test_summary_matches_monte_carlo():
    rng = random.Random(0)
    groups = [_group([float(rng.random() < p) for _ in range(8)]) for p in (0.1, 0.5, 0.9)]
    m = summarize(groups, [2], 1.0)
    est = []
    for g in groups:
        r = g.rewards
        est.append(sum(any(r[i] for i in rng.sample(range(8), 2)) for _ in range(20000)) / 20000)
    assert m["eval/pass@2"] == pytest.approx(sum(est) / 3, abs=0.01)


def test_eval_config_checks():
    assert problems(compose([])) == []
    keys = {k for k, _ in problems(compose(["eval.samples_per_task=2", "eval.k=[1,4]", "eval.every_n_steps=-1"]))}
    assert keys == {"eval.k", "eval.every_n_steps"}
