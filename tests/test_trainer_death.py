"""With `trainer.max_restarts=0` a dead trainer rank stops the run with an error naming the rank
and the last checkpoint, and `resume=true` continues from that checkpoint (a run that restarts
its trainer by itself: tests/test_trainer_heal.py)."""

import json
import threading
import time

import pytest

from rlcore.plan.compose import compose

pytestmark = pytest.mark.integration


def test_trainer_death_names_rank_and_checkpoint_then_resume(tmp_path):
    import ray

    from actors.driver import Driver, RunError
    from rlcore.plan.layout import run_plan
    from rlcore.report.metrics import MetricsLogger

    overrides = [
        f"output_dir={tmp_path}",
        "steps=8",
        "checkpoint.interval=2",
        "sft.warmup_steps=0",
        "logger.console=false",
        "trainer.max_restarts=0",
    ]
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    try:
        cfg = compose(overrides)
        driver = Driver(run_plan(cfg))

        def kill_trainer():
            while driver.run_state.version < 5:
                time.sleep(0.05)
            ray.kill(driver.trainers.handles[0], no_restart=True)

        try:
            driver.setup()
            threading.Thread(target=kill_trainer, daemon=True).start()
            with pytest.raises(RunError) as err:
                driver.run(MetricsLogger(cfg.logger, str(tmp_path), {}, cfg.steps))
        finally:
            driver.shutdown()
        msg = str(err.value)
        assert "trainer rank 0" in msg and "resume=true" in msg and "step_0000000" in msg, msg

        resumed = Driver(run_plan(compose([*overrides, "resume=true"])))
        try:
            resumed.setup()
            assert resumed.run_state.step in (4, 6)  # the newest checkpoint written before the death
            history = resumed.run(MetricsLogger(cfg.logger, str(tmp_path), {}, cfg.steps))
        finally:
            resumed.shutdown()
        assert history[-1]["step"] == 8
        steps = [
            json.loads(line)["step"]
            for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
            if "reward_mean" in line
        ]
        assert steps == list(range(1, 9))  # one series, no gap, no duplicate
    finally:
        ray.shutdown()
