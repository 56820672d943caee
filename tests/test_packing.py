import torch

from rlcore.batch.packing import balance_across_ranks, make_micro_batch, pack_first_fit, pack_for_ranks
from rlcore.types import Sample


def sample(p, c):
    return Sample(
        prompt_ids=p, completion_ids=c, logprobs=[-0.5] * len(c), versions=[0] * len(c), loss_mask=[1] * len(c)
    )


def test_alignment_of_targets_and_masks():
    mb = make_micro_batch([sample([1, 2], [3, 4]), sample([5], [6])], [0.5, -1.0])
    assert mb.input_ids.tolist() == [1, 2, 3, 4, 5, 6]
    assert mb.position_ids.tolist() == [0, 1, 2, 3, 0, 1]
    # position i predicts token i+1 of the same sample; completion tokens are trained on
    assert mb.targets.tolist()[:3] == [2, 3, 4] and mb.targets[4] == 6
    assert mb.loss_mask.tolist() == [0, 1, 1, 0, 1, 0]
    assert mb.advantages.tolist() == [0.5] * 4 + [-1.0] * 2
    assert mb.sample_index.tolist() == [0, 0, 0, 0, 1, 1]


def test_micro_batch_columns_equal_the_per_token_reference():
    """make_micro_batch fills its columns by slices; they must equal `sample_arrays`' per-token
    lists, for scalar and per-token advantages, masked env tokens, and a prompt-less sample."""
    import random

    from rlcore.batch.packing import sample_arrays

    rng = random.Random(0)
    samples, advantages = [], []
    for i in range(40):
        p, c = rng.randint(0 if i == 0 else 1, 9), rng.randint(0, 12)
        samples.append(
            Sample(
                prompt_ids=[rng.randrange(50) for _ in range(p)],
                completion_ids=[rng.randrange(50) for _ in range(c)],
                logprobs=[-rng.random() for _ in range(c)],
                versions=[0] * c,
                loss_mask=[rng.randint(0, 1) for _ in range(c)],
            )
        )
        advantages.append([rng.gauss(0, 1) for _ in range(c)] if i % 2 else rng.gauss(0, 1))
    mb = make_micro_batch(samples, advantages)
    ref = {k: [] for k in ("input_ids", "position_ids", "targets", "behaviour_logprobs", "advantages", "loss_mask")}
    index = []
    for j, (s, a) in enumerate(zip(samples, advantages)):
        for k, v in sample_arrays(s, a).items():
            ref[k].extend(v)
        index += [j] * s.num_tokens
    for k, v in ref.items():
        want = torch.tensor(v, dtype=torch.long if k in ("input_ids", "position_ids", "targets") else torch.float32)
        got = getattr(mb, k)
        assert got.dtype == want.dtype and torch.equal(got, want), k
    assert mb.sample_index.tolist() == index and mb.num_samples == len(samples)


def test_rank_balance_and_equal_micro_batch_counts():
    lengths = [10, 9, 8, 3, 2, 1]
    ranks = balance_across_ranks(lengths, 2)
    loads = [sum(lengths[i] for i in r) for r in ranks]
    assert abs(loads[0] - loads[1]) <= 1
    samples = [sample([1] * (n - 1), [2]) for n in lengths]
    shards = pack_for_ranks(samples, [0.0] * 6, num_ranks=4, micro_batch_tokens=10)
    assert len({len(s) for s in shards}) == 1
    assert sum(mb.num_samples for s in shards for mb in s if mb.loss_mask.sum() > 0) == 6


def test_first_fit_respects_budget():
    bins = pack_first_fit([5, 5, 4, 3, 3], list(range(5)), budget=8)
    assert all(sum([5, 5, 4, 3, 3][i] for i in b) <= 8 for b in bins)
    assert sorted(i for b in bins for i in b) == list(range(5))


def test_packed_logprobs_equal_unpacked(tiny_cfg, monkeypatch):
    """Samples packed in one row must not see each other (block-diagonal attention)."""
    import socket

    with socket.socket() as s:  # a free port: a fixed one collides with any other suite on the machine
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    from rlcore.trainer.core import TrainerCore

    core = TrainerCore(tiny_cfg, 0, 1)
    try:
        with torch.no_grad():
            for p in core.model.parameters():
                p.mul_(3.0)  # a context-sensitive model, so leakage would show
        samples = [sample([1, 10, 11, 12], [20, 21, 2]), sample([1, 30], [31, 32, 33, 2])]
        with torch.no_grad():
            packed, _ = core.forward_logprobs(make_micro_batch(samples, [0.0, 0.0]))
            single = torch.cat([core.forward_logprobs(make_micro_batch([s], [0.0]))[0] for s in samples])
        mask = make_micro_batch(samples, [0.0, 0.0]).loss_mask.bool()
        assert torch.allclose(packed[mask], single[mask], atol=1e-5)
    finally:
        core.shutdown()
