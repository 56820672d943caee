"""One RL step as data (rlcore.batch.step), without Ray: advantages, shards per data-parallel rank, the
loss normaliser and the batch metrics, worked out by hand."""

from __future__ import annotations

import pytest

from rlcore.batch.meta import group_meta
from rlcore.batch.step import build_step, has_signal, rank_micro_batches, sample_advantages
from rlcore.config import RunConfig
from rlcore.types import Group, GroupMeta, Sample, Task


def group(rewards, completion_len=3, teacher=None, finish="stop") -> GroupMeta:
    """A group as the driver holds it; its data handle is the sample list itself (no Ray)."""
    samples = [
        Sample(
            prompt_ids=[1, 2],
            completion_ids=[5] * completion_len,
            logprobs=[-1.0] * completion_len,
            versions=[0] * completion_len,
            loss_mask=[1] * completion_len,
            reward=r,
            finish_reason=finish,
            teacher_logprobs=teacher,
        )
        for r in rewards
    ]
    return group_meta(Group(Task("t", []), samples), data=samples)


def shards(step):
    """Every data-parallel rank's micro-batches, as the trainer ranks build them."""
    return [rank_micro_batches(work, work.data) for work in step.ranks]


def test_grpo_advantages_and_metrics_by_hand():
    cfg = RunConfig()
    cfg.algo.std_normalize = False
    batch = [group([1.0, 0.0]), group([0.5, 0.5], finish="length")]
    # group means 0.5 and 0.5: advantages +0.5, -0.5, 0, 0
    assert sample_advantages(batch, cfg.algo) == pytest.approx([0.5, -0.5, 0.0, 0.0])
    assert [has_signal(g) for g in batch] == [True, False]
    step = build_step(batch, cfg)
    assert len(step.ranks) == 1  # one data-parallel rank
    # ppo_clip normalises by the batch's loss tokens: 4 samples x 3 completion tokens
    assert step.normalizer == 12.0
    m = step.metrics
    assert m["reward_mean"] == pytest.approx(0.5) and m["batch_samples"] == 4
    assert m["zero_adv_frac"] == 0.5 and m["truncated_frac"] == 0.5 and m["completion_len_mean"] == 3


def test_unequal_groups_are_normalised_one_at_a_time():
    cfg = RunConfig()
    cfg.algo.std_normalize = False
    batch = [group([1.0, 0.0, 0.0]), group([2.0, 0.0])]
    # means 1/3 and 1
    assert sample_advantages(batch, cfg.algo) == pytest.approx([2 / 3, -1 / 3, -1 / 3, 1.0, -1.0])


def test_shards_balance_over_data_parallel_ranks():
    cfg = RunConfig()
    cfg.trainer.world_size = 2
    step = build_step([group([1.0, 0.0]), group([0.0, 1.0])], cfg)
    assert len(step.ranks) == 2
    assert [sum(int(mb.loss_mask.sum()) for mb in shard) for shard in shards(step)] == [6, 6]


def test_distillation_gives_per_token_advantages():
    cfg = RunConfig()
    cfg.algo.std_normalize = False
    cfg.teacher.kl_coef, cfg.teacher.reward_coef = 1.0, 0.0
    # behaviour -1.0, teacher -0.5 on every token: advantage q - s = +0.5 per token, teacher_kl -0.5
    step = build_step([group([1.0, 1.0], completion_len=2, teacher=[-0.5, -0.5])], cfg, distill=True)
    mb = shards(step)[0][0]
    assert mb.advantages[mb.loss_mask.bool()].tolist() == pytest.approx([0.5] * 4)
    assert step.metrics["teacher_kl"] == pytest.approx(-0.5)
