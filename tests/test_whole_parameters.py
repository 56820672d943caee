"""A colocated one-rank sync reads the parameters' own storage (`TrainerCore.whole_parameters`):
the aliases must name and hold exactly what `full_parameters` yields, and must follow the
optimizer's in-place updates without being rebuilt. No Ray: the rank is a plain process."""

import os

import torch
import torch.multiprocessing as mp

from rlcore.plan.compose import compose
from tests.ranks import leave_rank


def _rank(rank, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from rlcore.batch.packing import pack_for_ranks
    from rlcore.sft.dataset import build_dataset
    from rlcore.trainer.core import TrainerCore

    cfg = compose(["trainer.lr=0.01", "mode=sft", "sft.num_examples=8"])
    core = TrainerCore(cfg, 0, 1)
    whole = core.whole_parameters()
    before = {n: t.clone() for n, t in whole}
    data = build_dataset(cfg, core.tokenizer)
    shard = pack_for_ranks(data.samples, [0.0] * len(data.samples), 1, 4096)[0]
    core.sft_step(shard, sum(int(mb.loss_mask.sum()) for mb in shard))
    torch.save(
        {
            "names": [n for n, _ in whole],
            "before": before,
            "aliases": {n: t.clone() for n, t in whole},  # the list built before the step
            "full": {n: t.clone() for n, t in core.full_parameters()},
        },
        out,
    )
    core.shutdown()
    leave_rank()


def test_whole_parameters_alias_the_trained_storage(tmp_path):
    from rlcore.trainer.core import free_port

    out = tmp_path / "whole.pt"
    mp.start_processes(_rank, args=(free_port(), str(out)), nprocs=1, start_method="spawn", join=True)
    got = torch.load(out)
    assert got["names"] == list(got["full"])
    changed = 0
    for name, full in got["full"].items():
        assert torch.equal(got["aliases"][name], full), name  # followed the step, not rebuilt
        changed += not torch.equal(got["before"][name], full)
    assert changed > len(got["full"]) // 2  # the step moved the weights
