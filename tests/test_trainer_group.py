"""The trainer group (actors.trainer_group): a rank killed mid-run makes the group's next call
fail naming that rank (but the samples table's read of the last step's logprobs, which goes
without them and a warning); `restart` re-creates every rank in the same placement group bundles, and
the new group, loaded from the checkpoint saved before the kill, scores exactly as the old one
did (the path issue 31's trainer self-healing takes)."""

import logging

import pytest

from rlcore.plan.compose import compose
from rlcore.storage.checkpoint import CheckpointWriter

pytestmark = pytest.mark.integration

PAIRS = [([5, 6, 7, 8], [9, 10, 11]), ([12, 13], [14, 15, 16, 17])]


def test_a_killed_rank_is_named_and_restart_from_a_checkpoint_scores_as_before(tmp_path, caplog):
    import ray

    from actors.groups import place
    from actors.remote import ActorDied, get
    from actors.sft import warmup
    from rlcore.plan.layout import run_plan

    cfg = compose(
        [
            f"output_dir={tmp_path}",
            "sft.warmup_steps=2",
            "trainer.world_size=2",
            "trainer.cpus_per_rank=1",
            "logger.console=false",
        ]
    )
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    groups = None
    try:
        groups = place(run_plan(cfg), rollout=False)
        trainers = groups.trainers
        metas = trainers.start()
        version = warmup(cfg, trainers)  # the weights move away from the initial model
        assert version == 2
        path = trainers.save(CheckpointWriter(cfg), 2, lambda: {"kind": "sft", "step": 2})
        trained = get(trainers.canary(PAIRS), 120, "canary", trainers.names)[0]
        assert trainers.last_step_logprobs([(0, 0)], 2) == {}  # SFT steps: no RL step's samples to name

        ray.kill(trainers.handles[1], no_restart=True)
        with pytest.raises(ActorDied) as err:
            get(trainers.canary(PAIRS), 120, "canary", trainers.names)
        assert err.value.dead == ["trainer rank 1"]
        with caplog.at_level(logging.WARNING, logger="rlcore"):
            assert trainers.last_step_logprobs([(0, 0)], 2) == {}  # a display's read: never the run
        assert "samples table without trainer logprobs: trainer logprobs of version 2 failed: trainer rank 1" in (
            caplog.text
        )

        old = list(trainers.handles)
        assert trainers.restart() == metas  # same model, same parameter layout
        assert all(new != o for new, o in zip(trainers.handles, old))
        fresh = get(trainers.canary(PAIRS), 120, "canary", trainers.names)[0]
        assert fresh != trained  # new ranks start from the initial model, not the trained one
        assert trainers.load(path) == 2
        assert get(trainers.canary(PAIRS), 120, "canary", trainers.names)[0] == trained
    finally:
        if groups is not None:
            groups.shutdown()
        ray.shutdown()
