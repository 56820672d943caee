"""The trainer's per-token logprobs of the samples a step's table shows (the live page's
"logprob gap" colouring): the train step keeps what its own forward computed, and after it the
rank that held a shown sample answers for it by the table's key (nothing for the others, nothing
for another step); the table aligns it with the completion tokens. The train step itself knows
nothing of the table."""

from __future__ import annotations

import math
import socket

import pytest
import torch

from rlcore.batch.meta import group_meta
from rlcore.batch.packing import make_micro_batch
from rlcore.batch.step import build_step, rank_micro_batches, rank_sample_versions, sample_places
from rlcore.plan.compose import compose
from rlcore.report.samples import completion_logprobs, sample_rows, shown_keys
from rlcore.types import Group, Sample, Task


def sample(prompt: list[int], completion: list[int], mask: list[int] | None = None, reward: float = 0.0) -> Sample:
    n = len(completion)
    return Sample(
        prompt_ids=prompt,
        completion_ids=completion,
        logprobs=[-1.0] * n,
        versions=[0] * n,
        loss_mask=mask or [1] * n,
        reward=reward,
    )


def batch() -> list:
    """Two groups of two samples; one sample has an environment token (loss mask 0)."""
    g0 = Group(
        task=Task(id="a", messages=[{"role": "user", "content": "a"}]),
        samples=[sample([1, 10, 11], [20, 21, 22, 2], reward=1.0), sample([1, 12], [23, 2], reward=0.0)],
    )
    g1 = Group(
        task=Task(id="b", messages=[{"role": "user", "content": "b"}]),
        samples=[sample([1, 30], [31, 32, 33, 2], [1, 0, 1, 1], reward=0.5), sample([1, 34], [35, 2], reward=0.0)],
    )
    return [group_meta(g, data=g.samples) for g in (g0, g1)]


def test_each_rank_finds_the_shown_samples_it_holds_by_their_keys(tiny_cfg):
    groups = batch()
    keys = shown_keys(groups, 2)
    assert keys == [(0, 0), (1, 0)]  # one per group in turn, as the table picks them
    tiny_cfg.trainer.world_size = 2  # two data-parallel ranks: each finds its own, none twice
    plan = build_step(groups, tiny_cfg)
    assert len(plan.ranks) == 2
    found = [key for work in plan.ranks for key in sample_places(work, keys)]
    assert sorted(found) == keys
    for work in plan.ranks:
        data = [list(d) for d in work.data]
        mbs = rank_micro_batches(work, data)
        for (g, k), (b, j) in sample_places(work, keys).items():  # that very sample, at those positions
            local = work.bins[b][j]
            assert groups[g].data[k] is work.data[work.picks[local][0]][work.picks[local][1]]
            s = groups[g].data[k]
            assert mbs[b].input_ids[mbs[b].sample_index == j].tolist() == s.prompt_ids + s.completion_ids


def test_the_train_step_keeps_its_own_logprobs_and_they_are_read_after_it(tmp_path, monkeypatch):
    """One real train step of the tiny policy on CPU: the logprobs read after it for the shown
    samples are the step's forward under the weights before the update (checked against a forward
    of each sample alone, before the step), one per completion token once aligned, None on the
    environment token; asked for another version, the core answers nothing."""
    from rlcore.trainer.core import TrainerCore

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        monkeypatch.setenv("MASTER_PORT", str(s.getsockname()[1]))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    cfg = compose([f"output_dir={tmp_path / 'run'}", "trainer.micro_batch_tokens=9"])  # several micro-batches
    groups = batch()
    keys = shown_keys(groups, 2)
    plan = build_step(groups, cfg)
    [work] = plan.ranks
    data = [list(d) for d in work.data]
    core = TrainerCore(cfg, 0, 1)
    try:
        expected = {}
        with torch.no_grad():
            for g, k in keys:
                s = groups[g].data[k]
                logp, _ = core.forward_logprobs(make_micro_batch([s], [0.0]))
                p = len(s.prompt_ids)
                expected[g, k] = [
                    float(logp[p + t - 1]) if s.loss_mask[t] else None for t in range(len(s.completion_ids))
                ]
        mbs = rank_micro_batches(work, data)
        assert len(mbs) > 1
        result = core.train_step(mbs, plan.normalizer, rank_sample_versions(work, data))
        assert set(vars(result)) == {"metrics", "version", "lr"}  # the step returns no logprobs
        packed = core.last_step_logprobs(result.version, sample_places(work, keys))
        assert core.last_step_logprobs(result.version - 1, sample_places(work, keys)) == {}  # another step's
        got = {key: completion_logprobs(groups[key[0]].data[key[1]], packed[key]) for key in packed}
        with torch.no_grad():  # the update changed the weights: what came back is from before it
            after, _ = core.forward_logprobs(make_micro_batch([groups[0].data[0]], [0.0]))
    finally:
        core.shutdown()
    assert sorted(got) == keys
    for key in keys:
        s = groups[key[0]].data[key[1]]
        assert len(got[key]) == len(s.completion_ids)
        assert [x is None for x in got[key]] == [x is None for x in expected[key]]
        for a, b in zip(got[key], expected[key]):
            if b is not None:
                assert math.isfinite(a) and a < 0 and a == pytest.approx(b, abs=1e-4)
    assert got[1, 0][1] is None  # the environment token
    p = len(groups[0].data[0].prompt_ids)
    assert max(abs(float(after[p - 1 + t]) - got[0, 0][t]) for t in range(4)) > 1e-4
    rows = sample_rows(groups, str, 2, trainer_logprobs=packed)
    assert [len(r["trainer_logprobs"]) for r in rows] == [len(r["tokens"]) for r in rows]
    assert rows[0]["trainer_logprobs"] == [round(x, 4) for x in got[0, 0]]
