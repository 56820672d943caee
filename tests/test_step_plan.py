"""Refs, not data, through the driver: the step is planned from metadata (rlcore.batch.step.build_step
never sees a token) and each trainer rank packs the samples it fetched; together they must give
exactly the micro-batches the driver used to pack from whole groups."""

from __future__ import annotations

import random

import pytest
import torch

from rlcore.algo.distill import batch_token_advantages
from rlcore.batch.buffer import Accounting, RolloutBuffer
from rlcore.batch.meta import group_meta
from rlcore.batch.packing import (
    balance_across_ranks,
    empty_micro_batch,
    make_micro_batch,
    materialise,
    pack_first_fit,
    pack_for_ranks,
    plan_for_ranks,
)
from rlcore.batch.step import build_step, rank_micro_batches, sample_advantages
from rlcore.config import RunConfig
from rlcore.types import Group, Sample, Task

FIELDS = ("input_ids", "position_ids", "targets", "behaviour_logprobs", "advantages", "loss_mask", "sample_index")


def reference_pack(samples, advantages, num_ranks, budget):
    """The packing the driver did before the split (one function, whole samples in hand)."""
    lengths = [s.num_tokens for s in samples]
    per_rank = []
    for indices in balance_across_ranks(lengths, num_ranks):
        bins = pack_first_fit(lengths, indices, budget)
        per_rank.append([make_micro_batch([samples[i] for i in b], [advantages[i] for i in b]) for b in bins])
    most = max(len(r) for r in per_rank)
    for r in per_rank:
        r.extend(empty_micro_batch() for _ in range(most - len(r)))
    return per_rank


def assert_same(got, want):
    assert len(got) == len(want)
    for rank_got, rank_want in zip(got, want):
        assert len(rank_got) == len(rank_want)
        for a, b in zip(rank_got, rank_want):
            for k in FIELDS:
                assert torch.equal(getattr(a, k), getattr(b, k)), k
            assert a.num_samples == b.num_samples


def random_sample(rng, reward=None, failed=False, teacher=False):
    p, c = rng.randint(1, 12), rng.randint(1, 20)
    lp = [-rng.random() for _ in range(c)]
    return Sample(
        prompt_ids=[rng.randrange(99) for _ in range(p)],
        completion_ids=[rng.randrange(99) for _ in range(c)],
        logprobs=lp,
        versions=[rng.randint(0, 2)] * c,
        loss_mask=[rng.randint(0, 1) for _ in range(c)],
        reward=float(rng.randint(0, 2)) if reward is None else reward,
        failed=failed,
        finish_reason=rng.choice(["stop", "length"]),
        teacher_logprobs=[x - rng.random() for x in lp] if teacher else None,
    )


@pytest.mark.parametrize("num_ranks,budget", [(1, 64), (2, 40), (3, 25), (4, 8)])
def test_plan_then_materialise_equals_the_old_packing(num_ranks, budget):
    rng = random.Random(num_ranks * 100 + budget)
    samples = [random_sample(rng) for _ in range(23)]
    advantages = [rng.gauss(0, 1) for _ in samples]
    plan = plan_for_ranks([s.num_tokens for s in samples], num_ranks, budget)
    assert len({len(r) for r in plan}) == 1  # every rank steps the same number of micro-batches
    assert sorted(i for r in plan for b in r for i in b) == list(range(len(samples)))
    want = reference_pack(samples, advantages, num_ranks, budget)
    assert_same([materialise(samples, advantages, bins) for bins in plan], want)
    assert_same(pack_for_ranks(samples, advantages, num_ranks, budget), want)


class Store:
    """Token data by handle, counting what is read (the driver must read nothing)."""

    def __init__(self):
        self.data: dict[str, list[Sample]] = {}
        self.reads: list[str] = []

    def fetch(self, handles):
        self.reads.extend(handles)
        return [self.data[h] for h in handles]


def batch_through_the_buffer(rng, store, groups, distill):
    """Groups of unequal size with failed samples, as the driver's buffer hands them out."""
    buffer = RolloutBuffer(0, groups, Accounting())
    whole = []
    for gi in range(groups):
        samples = [random_sample(rng, failed=rng.random() < 0.2, teacher=distill) for _ in range(rng.randint(2, 5))]
        samples[0].failed = False
        g = Group(Task(f"t{gi}", []), samples, stream_index=gi)
        handle = f"group-{gi}"
        store.data[handle] = samples
        buffer.launched(len(samples))
        buffer.add(group_meta(g, data=handle))
        whole.append(g)
    batch = buffer.pop_batch(0, groups)
    return batch, [s for g in whole for s in g.samples if not s.failed]


@pytest.mark.parametrize("distill", [False, True])
@pytest.mark.parametrize("world,cp", [(1, 1), (2, 1), (4, 2)])
def test_ranks_build_the_micro_batches_the_driver_used_to(distill, world, cp):
    rng = random.Random(world * 10 + cp + distill)
    cfg = RunConfig()
    cfg.trainer.world_size, cfg.trainer.cp, cfg.trainer.micro_batch_tokens = world, cp, 48
    cfg.teacher.kl_coef, cfg.teacher.reward_coef, cfg.teacher.kl_baseline = 0.7, 0.5, True
    store = Store()
    batch, samples = batch_through_the_buffer(rng, store, 9, distill)
    step = build_step(batch, cfg, distill=distill)
    assert store.reads == []  # planned from metadata alone
    advantages = sample_advantages(batch, cfg.algo)
    if distill:
        advantages, metrics = batch_token_advantages(samples, advantages, 0.7, 0.5, center=True)
        assert step.metrics["teacher_kl"] == pytest.approx(metrics["teacher_kl"], rel=1e-12)
    want = reference_pack(samples, advantages, world // cp, 48)
    got = []
    for work in step.ranks:
        assert len(set(work.data)) == len(work.data)  # each group's data fetched once per rank
        store.reads = []
        got.append(rank_micro_batches(work, store.fetch(work.data)))
        used = {work.data[g] for g, _ in work.picks}
        assert set(store.reads) == used  # a rank reads the groups of its own samples only
    assert_same(got, want)
    assert step.normalizer == sum(float(mb.loss_mask.sum()) for r in want for mb in r)


def test_distill_without_teacher_logprobs_is_refused():
    rng = random.Random(0)
    store = Store()
    batch, _ = batch_through_the_buffer(rng, store, 2, distill=False)
    with pytest.raises(ValueError, match="teacher logprobs"):
        build_step(batch, RunConfig(), distill=True)
