"""The console around a run: the end-of-run summary, the step line, the zero-advantage warning,
start-up progress, and errors condensed to one line (issues 20 and 21)."""

import io
import logging
import subprocess
import sys
import traceback

import pytest

from rlcore.config import LoggerConfig
from rlcore.plan.compose import compose
from rlcore.report.console import actor_log_hint, one_line, quiet_ray_environment, report_error
from rlcore.report.metrics import MetricsLogger, format_line
from rlcore.report.startup import StartupPhases
from rlcore.report.summary import rates, run_summary, window_means, zero_advantage_steps
from rlcore.run import summary


def records(rewards, **extra):
    return [
        {
            "step": i + 1,
            "reward_mean": r,
            "step_time_s": 2.0,
            "tokens_per_s": 100.0,
            "samples_per_s": 4.0,
            "train_time_s": 0.5,
            "sync_time_s": 0.1,
            "generate_time_s": 1.5,
            "elapsed_s": 2.0 * (i + 1),
            **extra,
        }
        for i, r in enumerate(rewards)
    ]


def test_reward_compares_window_means_not_single_steps():
    # first step 0.0 and last step 1.0 are outliers: single steps would read 0.000 -> 1.000
    rewards = [0.0] + [0.4] * 9 + [0.5] * 10 + [0.6] * 9 + [1.0]
    first, last, w = window_means(records(rewards), "reward_mean")
    assert w == 10
    assert first == pytest.approx(0.36) and last == pytest.approx(0.64)
    text = run_summary("rl", records(rewards))
    assert "reward 0.360 -> 0.640 (means of the first and last 10 steps)" in text
    assert "0.000 -> 1.000" not in text


def test_short_run_windows_are_halves_that_do_not_overlap():
    assert window_means(records([0.2, 0.4, 0.6]), "reward_mean") == pytest.approx((0.2, 0.6, 1))
    assert "reward 0.200 -> 0.600 (means of the first and last 1 step)" in run_summary("rl", records([0.2, 0.4, 0.6]))
    assert window_means(records([0.1, 0.3] * 6), "reward_mean")[2] == 6


def test_summary_rates_times_eval_phases_and_artifact():
    hist = records([0.5] * 4)
    hist[0]["step_time_s"], hist[0]["tokens_per_s"] = 6.0, 50.0  # a slow first step
    tps, sps = rates(hist)
    assert tps == pytest.approx((6 * 50 + 3 * 2 * 100) / 12)  # totals over totals, not a mean of rates
    assert sps == pytest.approx(4.0)
    evals = [{"step": 2, "eval/reward_mean": 0.25}, {"step": 4, "eval/reward_mean": 0.75}]
    text = run_summary("rl", hist, evals, [("starting Ray", 3.0), ("placing actors", 1.5)], "plot: out/plot.png")
    lines = text.splitlines()
    assert lines[0] == "rlcore: done: 4 steps in 8s"
    assert "  eval reward 0.250 (step 2) -> 0.750 (step 4)" in lines
    assert f"  throughput {tps:.0f} tokens/s, 4.0 samples/s" in lines
    assert "  time generate 6.0s, train 2.0s, sync 0.4s (sums over steps)" in lines
    assert "  start-up 4.5s: starting Ray 3.0s, placing actors 1.5s" in lines
    assert lines[-1] == "  plot: out/plot.png"
    assert "eval" not in run_summary("rl", hist)  # no eval ran: no eval line


def test_summary_counts_zero_advantage_steps():
    hist = records([0.5] * 5)
    for r, frac in zip(hist, [1.0, 1.0, 0.5, 0.0, 1.0]):
        r["zero_adv_frac"] = frac
    assert zero_advantage_steps(hist) == 3
    assert "zero-advantage steps 3 of 5" in run_summary("rl", hist)
    assert "zero-advantage" not in run_summary("rl", records([0.5] * 5))


def test_sft_and_eval_summaries():
    sft = [{"step": i + 1, "loss": 2.0 if i < 10 else 1.0} for i in range(20)]
    assert "loss 2.0000 -> 1.0000" in run_summary("sft", sft)
    ev = [{"step": 7, "eval/reward_mean": 0.5, "eval/pass@1": 0.4, "eval/pass@4": 0.8}]
    assert run_summary("eval", ev).startswith(
        "rlcore: done: eval of step 7: reward_mean 0.500, pass@1 0.400, pass@4 0.800"
    )


def test_summary_points_to_the_plot_when_the_run_wrote_one(tmp_path):
    cfg = compose([f"output_dir={tmp_path}"])
    assert f"metrics: {tmp_path / 'metrics.jsonl'}" in summary(cfg, records([0.5]))
    (tmp_path / "plot.png").write_bytes(b"\x89PNG")
    assert f"plot: {tmp_path / 'plot.png'}" in summary(cfg, records([0.5]))


def test_console_line_shows_grad_norm():
    line = format_line({"step": 3, "reward_mean": 0.5, "loss": 0.0, "grad_norm": 0.0, "entropy": 1.0})
    assert "grad_norm 0.000 |" in line
    assert "grad_norm 0.012" in format_line({"step": 3, "grad_norm": 0.012345})


def test_console_line_shows_the_teacher_kls_of_a_distillation_run():
    line = format_line({"step": 3, "entropy": 1.0, "teacher_kl": 2.5, "teacher_top_k_kl": 0.8125, "staleness_kl": 0.01})
    assert "entropy 1.000 | teacher_kl 2.500 | teacher_top_k_kl 0.812 | staleness_kl" in line
    assert "teacher" not in format_line({"step": 3, "entropy": 1.0})


def test_zero_advantage_warns_once(tmp_path, caplog):
    logger = MetricsLogger(LoggerConfig(console=False), str(tmp_path), {}, 3)
    with caplog.at_level(logging.WARNING, logger="rlcore"):
        logger.log({"step": 1, "zero_adv_frac": 0.5})
        assert not caplog.records
        logger.log({"step": 2, "zero_adv_frac": 1.0})
        logger.log({"step": 3, "zero_adv_frac": 1.0})
    logger.close()
    logger.close()  # idempotent: run.main closes it before the summary and again on the way out
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and warnings[0].startswith("step 2: every group has zero advantage")


def test_startup_phases_print_and_time_each_phase():
    ticks = iter([10.0, 12.5, 20.0, 21.0, 30.0, 40.0])
    out = io.StringIO()
    phases = StartupPhases(stream=out, clock=lambda: next(ticks))
    with phases.phase("starting Ray"):
        pass
    with phases.phase("SFT warm-up (40 steps)", chatty=True):
        pass
    with pytest.raises(RuntimeError), phases.phase("first weight sync"):
        raise RuntimeError("sync failed")
    with pytest.raises(KeyboardInterrupt), phases.phase("placing actors"):
        raise KeyboardInterrupt
    assert phases.done == [("starting Ray", 2.5), ("SFT warm-up (40 steps)", 1.0)]
    assert out.getvalue().splitlines() == [
        "rlcore: starting Ray ... 2.5s",
        "rlcore: SFT warm-up (40 steps) ...",
        "rlcore: SFT warm-up (40 steps): done in 1.0s",
        "rlcore: first weight sync ... failed",
        "rlcore: placing actors ... interrupted",
    ]


def test_remote_traceback_becomes_one_line_naming_the_log(tmp_path):
    import ray

    try:
        raise ValueError("size mismatch [100, 128] vs [49152, 576]")
    except ValueError as exc:
        err = ray.exceptions.RayTaskError(
            "TrainerRank.load_checkpoint", traceback.format_exc(), exc, pid=7, ip="127.0.0.1", actor_repr="TrainerRank"
        )
    message = f"weight sync to version 3 failed: {err}; last checkpoint: {tmp_path}/step_2; continue with resume=true"
    assert message.count("\n") >= 2  # a real remote traceback spans lines
    line = report_error(message, str(tmp_path))
    assert "\n" not in line and "\x1b" not in line
    assert line.startswith("rlcore: error: weight sync to version 3 failed: ")
    assert "ValueError: size mismatch [100, 128] vs [49152, 576]; last checkpoint:" in line
    assert line.endswith(f"(logs: {tmp_path / 'logs'}/)")
    assert "ValueError: size mismatch" in (tmp_path / "logs" / "errors.log").read_text()  # the whole text kept


def test_log_hint_names_the_one_failing_actor(tmp_path):
    hint = actor_log_hint("train step 4 failed: trainer rank 1 died (...)", "out")
    assert hint == "actor log: out/logs/trainer-1.log"
    assert actor_log_hint("generate on rollout actor 0 failed", "out") == "actor log: out/logs/rollout-0.log"
    assert actor_log_hint("rollout actor 0, rollout actor 1 died", "out") == "logs: out/logs/"
    assert one_line("one line stays") == "one line stays"


def test_local_ray_is_told_its_auth_mode(monkeypatch):
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    quiet_ray_environment()
    import os

    assert os.environ["RAY_AUTH_MODE"] == "token"  # explicit: Ray's warning is for an unset mode


def test_actor_output_goes_to_its_log_file(tmp_path):
    """Python prints, and writes to the raw file descriptors (as C++ logging does), both land in
    OUTPUT_DIR/logs/KIND-INDEX.log and not on the process's own stdout/stderr."""
    code = (
        "import os, sys; from actors.logs import redirect_output; "
        f"redirect_output({str(tmp_path)!r}, 'rollout', 2); print('from python'); "
        "sys.stderr.write('py stderr\\n'); os.write(2, b'mutex.cc RAW: Lock blocking\\n')"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "" and proc.stderr == ""
    text = (tmp_path / "logs" / "rollout-2.log").read_text()
    assert "from python" in text and "py stderr" in text and "RAW: Lock blocking" in text
