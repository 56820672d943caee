"""Start-up phases that do not depend on each other run at once (issue 35): the engines start
while the trainer starts and runs its SFT warm-up, the first sync waits for both, an engine that
breaks meanwhile is an error at once, and the summary's start-up figure is wall time to step 1."""

import io
import time

import pytest

from rlcore.report.startup import StartupPhases, process_age
from rlcore.report.summary import run_summary


def test_background_phase_lines_and_record():
    ticks = iter([0.0, 1.0, 4.0, 9.0])
    out = io.StringIO()
    phases = StartupPhases(stream=out, clock=lambda: next(ticks))
    engines = phases.background("starting the rollout engine (hf)")  # t=0
    with phases.phase("starting the trainer and loading its model (concurrent with the engine)"):  # 1 .. 4
        pass
    assert engines.finish(waited_s=2.0) == 9.0
    assert engines.finish() == 9.0  # idempotent: one line, one record
    assert phases.done == [
        ("starting the trainer and loading its model (concurrent with the engine)", 3.0),
        ("starting the rollout engine (hf) (in the background)", 9.0),
    ]
    assert out.getvalue().splitlines() == [
        "rlcore: starting the rollout engine (hf) (in the background) ...",
        "rlcore: starting the trainer and loading its model (concurrent with the engine) ... 3.0s",
        "rlcore: starting the rollout engine (hf): ready after 9.0s (in the background; 2.0s waited for)",
    ]


def test_summary_startup_is_wall_time_not_the_sum_of_overlapping_phases():
    hist = [{"step": 1, "reward_mean": 0.5, "step_time_s": 1.0, "tokens_per_s": 10.0, "samples_trained": 4}]
    phases = [
        ("starting Ray", 3.0),
        ("starting the rollout engine (hf) (in the background)", 20.0),
        ("SFT warm-up (40 steps)", 15.0),
    ]
    lines = run_summary("rl", hist, [], phases, startup_s=24.5).splitlines()
    assert (
        "  start-up 24.5s to step 1 (from the process's start): starting Ray 3.0s, starting the rollout "
        "engine (hf) (in the background) 20.0s, SFT warm-up (40 steps) 15.0s"
    ) in lines
    assert "  start-up 38.0s: " in run_summary("rl", hist, [], phases)  # no wall time given: the sum


def test_process_age_counts_from_the_process_start():
    age = process_age()
    assert 0.0 < age < time.monotonic()  # the interpreter started before this test, after boot
    time.sleep(0.05)
    assert process_age() - age >= 0.04


# -- on a local Ray cluster ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    yield ray
    ray.shutdown()


def _cfg(tmp_path, env: list[str], warmup: int = 3):
    from rlcore.plan.compose import compose

    return compose(
        [
            f"output_dir={tmp_path}",
            "steps=1",
            f"sft.warmup_steps={warmup}",
            "algo.batch_groups=2",
            "rollout.tasks_per_request=2",
            "rollout.max_restarts=0",
            "logger.console=false",
            *env,
        ]
    )


def _open_gate_when_the_warmup_begins(monkeypatch, gate) -> None:
    """The SFT warm-up creates the file `gate` as it begins (the chaos envs' start-up waits on it)."""
    import actors.lifecycle

    real_warmup = actors.lifecycle.warmup

    def warmup_opening_the_gate(cfg, trainers, between):
        gate.touch()
        return real_warmup(cfg, trainers, between)

    monkeypatch.setattr(actors.lifecycle, "warmup", warmup_opening_the_gate)


@pytest.mark.integration
def test_engines_finish_starting_only_while_the_sft_warmup_runs(ray_cluster, tmp_path, monkeypatch, capsys):
    """The engine's construction waits for a gate that the warm-up opens: a start-up that waited
    for the engines before the warm-up could never finish (the engine gives up and dies)."""
    from actors.driver import Driver
    from rlcore.plan.layout import run_plan
    from rlcore.report.metrics import MetricsLogger

    gate = tmp_path / "gate"
    _open_gate_when_the_warmup_begins(monkeypatch, gate)
    cfg = _cfg(
        tmp_path / "run",
        ["env.name=tests.chaos_env:GatedStartReverseText", f"+env.args.gate={gate}", "+env.args.gate_timeout_s=150"],
    )
    driver = Driver(run_plan(cfg))
    try:
        driver.setup()
        out = capsys.readouterr().out
        lines = [ln for ln in out.splitlines() if ln.startswith("rlcore: ")]
        started = lines.index("rlcore: starting the rollout engine (hf) (in the background) ...")
        warmup = lines.index("rlcore: SFT warm-up (3 steps) ...")
        ready = next(
            i for i, ln in enumerate(lines) if ln.startswith("rlcore: starting the rollout engine (hf): ready after")
        )
        sync = next(i for i, ln in enumerate(lines) if ln.startswith("rlcore: first weight sync ..."))
        assert started < warmup < ready < sync, lines
        assert any(
            ln.startswith("rlcore: starting the trainer and loading its model (concurrent with the engine)")
            for ln in lines
        )
        history = driver.run(MetricsLogger(cfg.logger, str(cfg.output_dir), {}, cfg.steps))
        assert [h["policy_version"] for h in history] == [cfg.sft.warmup_steps + 1]
        assert 0 < driver.ready_at < process_age()
    finally:
        driver.shutdown()


@pytest.mark.integration
def test_engine_that_breaks_during_startup_stops_the_warmup(ray_cluster, tmp_path, monkeypatch, capsys, caplog):
    """The warm-up checks the engines between its steps: the broken engine's error comes out
    within a step or two, not after the whole warm-up nor at a deadline. The engine breaks only
    once the warm-up has begun (a gate the warm-up opens), so the check is not a race with the
    trainer's start."""
    from actors.driver import Driver
    from actors.remote import RunError
    from rlcore.plan.layout import run_plan

    gate = tmp_path / "gate"
    _open_gate_when_the_warmup_begins(monkeypatch, gate)
    cfg = _cfg(
        tmp_path / "run",
        [
            "env.name=tests.chaos_env:BrokenStartReverseText",
            "+env.args.delay_s=0",
            f"+env.args.gate={gate}",
            "+env.args.gate_timeout_s=150",
        ],
        warmup=1000,
    )
    driver = Driver(run_plan(cfg))
    start = time.monotonic()
    try:
        with pytest.raises(
            RunError, match="(?s)rollout actor 0 died while starting.*RuntimeError: engine broke during start-up"
        ):
            driver.setup()
    finally:
        driver.shutdown()
    out = capsys.readouterr().out
    assert "rlcore: starting the rollout engine (hf) (in the background): failed" in out
    assert "rlcore: SFT warm-up (1000 steps): failed" in out
    assert "first weight sync" not in out
    assert not any("SFT warm-up step 1000/1000" in r.getMessage() for r in caplog.records)
    assert time.monotonic() - start < 150
