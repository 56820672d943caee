"""The trainer's per-token logprobs of the samples a step's table shows (the live page's
"logprob gap" colouring): the rank that holds a shown sample returns what its train step's own
forward computed for it, aligned with the completion tokens, and nothing for the others."""

from __future__ import annotations

import math
import socket

import pytest
import torch

from rlcore.batch.meta import group_meta
from rlcore.batch.packing import make_micro_batch
from rlcore.batch.step import build_step, rank_micro_batches, rank_sample_versions, shown_logprobs, shown_positions
from rlcore.plan.compose import compose
from rlcore.report.samples import sample_rows, shown_keys
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


def test_only_the_shown_samples_are_marked_with_their_keys(tiny_cfg):
    groups = batch()
    keys = shown_keys(groups, 2)
    assert keys == [(0, 0), (1, 0)]  # one per group in turn, as the table picks them
    plan = build_step(groups, tiny_cfg, shown=keys)
    marked = [key for work in plan.ranks for key in work.shown.values()]
    assert sorted(marked) == keys
    for work in plan.ranks:
        for local, (g, k) in work.shown.items():  # rank-local sample -> the key of that very sample
            assert groups[g].data[k] is work.data[work.picks[local][0]][work.picks[local][1]]
    assert all(not w.shown for w in build_step(groups, tiny_cfg).ranks)  # a step without a table marks none


def test_the_train_step_returns_its_own_logprobs_of_the_shown_samples(tmp_path, monkeypatch):
    """One real train step of the tiny policy on CPU: the logprobs returned for the shown samples
    are the step's forward under the weights before the update (checked against a forward of each
    sample alone, before the step), one per completion token, None on the environment token."""
    from rlcore.trainer.core import TrainerCore

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        monkeypatch.setenv("MASTER_PORT", str(s.getsockname()[1]))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    cfg = compose([f"output_dir={tmp_path / 'run'}", "trainer.micro_batch_tokens=9"])  # several micro-batches
    groups = batch()
    keys = shown_keys(groups, 2)
    plan = build_step(groups, cfg, shown=keys)
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
        result = core.train_step(mbs, plan.normalizer, rank_sample_versions(work, data), shown_positions(work))
        got = shown_logprobs(work, data, result.kept)
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
    rows = sample_rows(groups, str, 2, trainer_logprobs=got)
    assert [len(r["trainer_logprobs"]) for r in rows] == [len(r["tokens"]) for r in rows]
    assert rows[0]["trainer_logprobs"] == [round(x, 4) for x in got[0, 0]]
