"""When `actors.recovery.TrainerRecovery` does not restart the trainer group, and what the error
says then (the restart itself: tests/test_trainer_heal.py)."""

from pathlib import Path
from types import SimpleNamespace

import pytest

from actors.recovery import TrainerRecovery, dead_trainer_ranks
from actors.remote import ActorDied, RunError
from rlcore.plan.compose import compose
from rlcore.report.failures import FailureLog


def recovery(tmp_path: Path, *overrides: str, checkpoint: Path | None = None) -> TrainerRecovery:
    cfg = compose([f"output_dir={tmp_path}", *overrides])
    # only what the decision reads: the checkpoint to go back to, and where the run stands
    hooks = SimpleNamespace(newest_checkpoint=lambda: checkpoint)
    return TrainerRecovery(
        cfg.trainer, None, None, None, hooks, SimpleNamespace(step=3, version=3), None, None, FailureLog(0)
    )


def trainer_died() -> ActorDied:
    return ActorDied("train step 3 failed: trainer rank 1 died (boom)", ["trainer rank 1"])


def test_only_a_trainer_rank_death_is_healed():
    assert dead_trainer_ranks(trainer_died()) == ["trainer rank 1"]
    assert dead_trainer_ranks(ActorDied("weight sync failed", ["rollout actor 0"])) == []
    assert dead_trainer_ranks(RunError("train step 3 did not finish within 600s")) == []


def test_other_errors_and_max_restarts_0_stop_with_the_same_error(tmp_path):
    engine = ActorDied("engine wake-up failed: rollout actor 0 died", ["rollout actor 0"])
    with pytest.raises(ActorDied) as err:
        recovery(tmp_path, checkpoint=tmp_path).recover(engine, None)
    assert err.value is engine
    died = trainer_died()
    with pytest.raises(ActorDied) as err:
        recovery(tmp_path, "trainer.max_restarts=0", checkpoint=tmp_path).recover(died, None)
    assert err.value is died


def test_no_checkpoint_says_so_first_in_a_short_line(tmp_path):
    """Only where the engines' weights are refused (trainer.heal_from=checkpoint): by default a
    death with no checkpoint is healed from them (tests/test_trainer_heal.py). The reason comes
    first and the death's own message is cut: the old line was 1,046 characters, its cause at 819."""
    long = ActorDied("train step 3 failed: trainer rank 1 died (" + "x" * 1000 + ")", ["trainer rank 1"])
    with pytest.raises(RunError) as err:
        recovery(tmp_path, "trainer.heal_from=checkpoint").recover(long, None)
    msg = str(err.value)
    assert msg.startswith("trainer rank 1 died and the trainer group was not restarted: no checkpoint exists"), msg
    assert "checkpoint.interval" in msg and len(msg) < 600, msg


def test_past_max_restarts_the_error_names_the_rank_and_the_limit(tmp_path):
    r = recovery(tmp_path, "trainer.max_restarts=2", checkpoint=tmp_path / "checkpoints" / "step_0000004")
    r.restarts = 2
    with pytest.raises(RunError) as err:
        r.recover(trainer_died(), None)
    msg = str(err.value)
    assert "trainer rank 1" in msg and "trainer.max_restarts=2" in msg, msg


def test_rows_logged_after_the_series_is_cut_back_land_in_metrics_jsonl(tmp_path):
    """A restart cuts metrics.jsonl back (a new file) while the logger holds it open."""
    import json

    from rlcore.report.metrics import MetricsLogger
    from rlcore.storage.rundir import truncate_series

    cfg = compose([f"output_dir={tmp_path}", "logger.console=false"])
    logger = MetricsLogger(cfg.logger, str(tmp_path), {}, 3)
    try:
        for step in (1, 2, 3):
            logger.log({"step": step})
        assert truncate_series(tmp_path / "metrics.jsonl", 1) == 2
        logger.reopen()
        logger.log({"step": 2})
    finally:
        logger.close()
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]
