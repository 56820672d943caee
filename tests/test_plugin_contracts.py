"""Losses and advantage estimators added from outside the package, without editing its files:
by import path (`algo.loss=tests.my_loss:loss`, `algo.name=tests.my_estimator:median_baseline`)
and by registering a spec. Each is validated before anything starts, and is what the loss, the
normaliser, the estimator and the trainer then run. Old flat per-loss keys are refused with
their new key. One short real run of the default job trains with the outside loss."""

from __future__ import annotations

import json
import math
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlcore.algo import validate_algo
from rlcore.algo.advantages import compute_advantages
from rlcore.algo.losses import LossInputs, loss_normalizer, policy_loss
from rlcore.algo.registry import (
    EstimatorSpec,
    LossSpec,
    register_estimator,
    register_loss,
    sample_count,
    unregister_estimator,
    unregister_loss,
)
from rlcore.config import AlgoConfig
from rlcore.config.losses import MOVED
from rlcore.plan.compose import compose
from rlcore.run import main

REPO = Path(__file__).resolve().parent.parent
MY_LOSS = "tests.my_loss:loss"
MY_ESTIMATOR = "tests.my_estimator:median_baseline"


def inputs(logp, ratios, adv) -> LossInputs:
    """Inputs whose ratio exp(logp - behaviour) is `ratios` token by token."""
    logp_t = torch.tensor(logp, requires_grad=True)
    behaviour = torch.tensor([lp - math.log(r) for lp, r in zip(logp, ratios, strict=True)])
    return LossInputs(
        logp_t,
        behaviour,
        torch.tensor(adv),
        torch.ones(len(logp)),
        sample_index=torch.zeros(len(logp), dtype=torch.long),
    )


def test_a_loss_by_import_path_validates_and_is_what_policy_loss_runs():
    cfg = AlgoConfig(loss=MY_LOSS)
    assert validate_algo(cfg) == []
    # l = -A logp = [-(1)(-1), -(-1)(-2)] = [1, -2], sum -1, token mean over 2 -> -0.5;
    # d/dlogp = -A / 2 = [-0.5, 0.5]; no ratio is used (reported 1), nothing clipped
    inp = inputs([-1.0, -2.0], [1.5, 0.5], [1.0, -1.0])
    normalizer = loss_normalizer(cfg, num_tokens=2, num_samples=1)
    assert normalizer == 2.0
    loss, m = policy_loss(inp, cfg, normalizer)
    loss.backward()
    assert loss.item() == pytest.approx(-0.5)
    assert inp.logprobs.grad.tolist() == pytest.approx([-0.5, 0.5])
    assert (m["clip_frac"].item(), m["ratio_sum"].item(), m["ratio_max"].item()) == (0.0, 2.0, 1.0)
    # the default loss on the same tokens: both ratios clipped, max(-1.5, -1.2) + max(0.5, 0.8) = -0.4
    ppo, _ = policy_loss(inputs([-1.0, -2.0], [1.5, 0.5], [1.0, -1.0]), AlgoConfig(), normalizer)
    assert ppo.item() == pytest.approx(-0.2)


def _scaled_ppo(log_ratio, adv, cfg, ctx):
    """A quarter of ppo_clip's unclipped surrogate, with its own notion of 'clipped' (A < 0)."""
    ratio = torch.exp(log_ratio)
    return -0.25 * adv * ratio, adv < 0, ratio


def _no_wide_clip(cfg):
    return [("algo.clip_eps_high", "quarter_pg wants clip_eps_high <= 0.5")] if cfg.clip_eps_high > 0.5 else []


@pytest.fixture
def quarter_pg():
    spec = register_loss(LossSpec("quarter_pg", _scaled_ppo, normalizer=sample_count, problems=_no_wide_clip))
    yield spec
    unregister_loss(spec.name)


def test_a_registered_loss_runs_with_its_normaliser_and_checks(quarter_pg):
    cfg = AlgoConfig(loss="quarter_pg")
    assert validate_algo(cfg) == []
    assert validate_algo(AlgoConfig(loss="quarter_pg", clip_eps_high=0.9)) == [
        ("algo.clip_eps_high", "quarter_pg wants clip_eps_high <= 0.5")
    ]
    assert loss_normalizer(cfg, num_tokens=37, num_samples=4) == 4.0  # its own: a sample count
    # l = -0.25 A r = [-0.25 * 2, 0.25 * 0.5] = [-0.5, 0.125], sum -0.375 / 1
    loss, m = policy_loss(inputs([-1.0, -1.0], [2.0, 0.5], [1.0, -1.0]), cfg, 1.0)
    assert loss.item() == pytest.approx(-0.375)
    assert m["clip_frac"].item() == 1.0  # the one token with A < 0


def test_an_options_section_must_exist_in_the_schema():
    from dataclasses import dataclass

    @dataclass
    class Mine:
        eps: float = 0.1

    with pytest.raises(ValueError, match="AlgoConfig field algo.mine"):
        register_loss(LossSpec("mine", _scaled_ppo, options=Mine))


def test_an_estimator_by_import_path_and_registered():
    # medians (lower middle for n = 4): group 0 [0, 1, 1, 5] -> 1, group 1 [2, 2, 2, 2] -> 2
    rewards = torch.tensor([[0.0, 1.0, 5.0, 1.0], [2.0, 2.0, 2.0, 2.0]])
    expected = [[-1.0, 0.0, 4.0, 0.0], [0.0, 0.0, 0.0, 0.0]]
    assert validate_algo(AlgoConfig(name=MY_ESTIMATOR)) == []
    assert compute_advantages(rewards, AlgoConfig(name=MY_ESTIMATOR)).tolist() == expected
    from tests.my_estimator import median_baseline

    register_estimator(EstimatorSpec("median", median_baseline))
    try:
        assert validate_algo(AlgoConfig(name="median")) == []
        assert compute_advantages(rewards, AlgoConfig(name="median")).tolist() == expected
    finally:
        unregister_estimator("median")
    assert any(k == "algo.name" for k, _ in validate_algo(AlgoConfig(name="median")))


def test_a_loss_by_path_takes_its_options():
    # l = -scale * max(A, floor) * logp on logp [-1, -2], A [1, -1]: scale 2, floor -0.5:
    # -2 * 1 * -1 + -2 * -0.5 * -2 = 2 - 2 = 0; without options: -1 * -1 + 1 * -2 = 1 - 2 = -1
    cfg = AlgoConfig(loss="tests.my_loss:scaled", loss_options={"scale": 2.0, "floor": -0.5})
    assert validate_algo(cfg) == []
    loss, _ = policy_loss(inputs([-1.0, -2.0], [1.0, 1.0], [1.0, -1.0]), cfg, 1.0)
    assert loss.item() == pytest.approx(0.0)
    plain, _ = policy_loss(inputs([-1.0, -2.0], [1.0, 1.0], [1.0, -1.0]), AlgoConfig(loss="tests.my_loss:scaled"), 1.0)
    assert plain.item() == pytest.approx(-1.0)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (
            ["algo.loss=tests.my_loss:scaled", "+algo.loss_options.sacle=2"],
            "algo.loss_options: 'scaled'(log_ratio, adv, cfg, ctx, scale: float = 1.0, floor: float | None = None) "
            "does not take ['sacle']",
        ),
        (["algo.loss=tests.my_loss:loss", "+algo.loss_options.scale=2"], "algo.loss_options: 'loss'"),
        (
            ["algo.loss=dapo", "+algo.loss_options.scale=2"],
            "algo.loss_options: options are passed to a loss given by import path (algo.loss=pkg.mod:fn); "
            "algo.loss=dapo is built in: set its own section (algo.dapo.*)",
        ),
    ],
)
def test_loss_options_a_loss_cannot_take_are_one_line_before_start(overrides, message, tmp_path, capsys):
    assert main([*overrides, f"output_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"rlcore: config error: {message}"), err


@pytest.mark.parametrize(
    "override,message",
    [
        ("algo.loss=tests.no_such_module:loss", "algo.loss: cannot import 'tests.no_such_module' (ModuleNotFoundError"),
        ("algo.loss=tests.my_loss:nope", "algo.loss: module 'tests.my_loss' has no 'nope'"),
        (
            "algo.loss=tests.my_loss:torch",
            "algo.loss: 'tests.my_loss:torch' is a module, not a loss function or LossSpec",
        ),
        (f"algo.loss={MY_ESTIMATOR}", "algo.loss: 'median_baseline' must take (log_ratio, adv, cfg, ctx)"),
        (f"algo.name={MY_LOSS}", "algo.name: 'loss' must take (rewards, cfg)"),
        ("algo.name=tests.my_estimator:", "algo.name: 'tests.my_estimator:' is not an import path"),
    ],
)
def test_a_bad_import_path_is_one_line_before_start(override, message, tmp_path, capsys):
    assert main([override, f"output_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"rlcore: config error: {message}"), err


@pytest.mark.parametrize("old,new", sorted(MOVED.items()))
def test_an_old_flat_loss_key_is_refused_naming_its_section(old, new, tmp_path, capsys):
    assert main([f"algo.{old}=1", f"output_dir={tmp_path}"]) == 2
    loss = new.partition(".")[0]
    assert capsys.readouterr().err.strip().splitlines() == [
        f"rlcore: config error: algo.{old}: moved to algo.{new} (loss {loss}'s own section)"
    ]
    assert compose([f"algo.{new}=1", f"output_dir={tmp_path}"]) is not None  # the new key exists


def test_the_trainer_uses_the_configured_loss(tmp_path, monkeypatch):
    """One real train step of the tiny policy with `algo.loss=tests.my_loss:loss`: its loss is
    -sum A logp / tokens of the step's own logprobs, its ratio 1 (the default loss would report
    the engine ratio exp(logp + 0.5) and another loss value)."""
    from rlcore.batch.packing import make_micro_batch
    from rlcore.trainer.core import TrainerCore
    from rlcore.types import Sample

    with socket.socket() as s:  # a free port: a fixed one collides with any other suite on the machine
        s.bind(("127.0.0.1", 0))
        monkeypatch.setenv("MASTER_PORT", str(s.getsockname()[1]))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    cfg = compose([f"output_dir={tmp_path / 'run'}", f"algo.loss={MY_LOSS}"])
    samples = [
        Sample(prompt_ids=p, completion_ids=c, logprobs=[-0.5] * len(c), versions=[0] * len(c), loss_mask=[1] * len(c))
        for p, c in (([1, 10, 11], [20, 21, 2]), ([1, 30], [31, 2]))
    ]
    mb = make_micro_batch(samples, [1.0, -1.0])
    core = TrainerCore(cfg, 0, 1)
    try:
        with torch.no_grad():
            logp, _ = core.forward_logprobs(mb)
        mask = mb.loss_mask > 0
        normalizer = loss_normalizer(cfg.algo, int(mask.sum()), len(samples))
        expected = float(-(mb.advantages * logp)[mask].sum() / normalizer)
        default = float(
            policy_loss(
                LossInputs(logp, mb.behaviour_logprobs, mb.advantages, mb.loss_mask, sample_index=mb.sample_index),
                AlgoConfig(),
                normalizer,
            )[0]
        )
        assert abs(expected - default) > 1e-3  # the two losses are told apart on this batch
        metrics = core.train_step([mb], normalizer).metrics
    finally:
        core.shutdown()
    assert metrics["loss"] == pytest.approx(expected, abs=1e-5)
    assert metrics["ratio_mean"] == metrics["ratio_max"] == metrics["ratio_min"] == 1.0
    assert metrics["clip_frac"] == 0.0


@pytest.mark.integration
def test_the_default_job_trains_with_a_loss_from_outside_the_package(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlcore.run",
            f"algo.loss={MY_LOSS}",
            "steps=3",
            "sft.warmup_steps=0",
            f"output_dir={out}",
            "logger.console=false",
            "cluster.num_cpus=2",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3
    # the trainer ranks (other processes) ran tests.my_loss: ratio exactly 1, nothing clipped.
    # The default ppo_clip on the same command measured ratio_min/max 0.999999/1.000001 at step 1
    # (engine and trainer logprobs differ in the last bits), 0.35/2.72 and clip_frac 0.33 at step 2
    for row in rows:
        assert row["ratio_min"] == row["ratio_max"] == 1.0 and row["clip_frac"] == 0.0, row
        assert math.isfinite(row["loss"]) and row["loss_tokens"] > 0, row
    assert "loss: tests.my_loss:loss" in (out / "config.yaml").read_text()


def test_a_registered_spec_naming_a_missing_module_is_refused_before_start():
    register_loss(LossSpec("lost", "tests.no_such_module:surrogate"))
    try:
        assert validate_algo(AlgoConfig(loss="lost")) == [
            (
                "algo.loss",
                "'lost' names 'tests.no_such_module:surrogate', but there is no module 'tests.no_such_module'",
            )
        ]
    finally:
        unregister_loss("lost")


def test_a_plugin_returning_the_wrong_shape_is_named_at_its_first_call():
    register_loss(LossSpec("scalar", lambda log_ratio, adv, cfg, ctx: (log_ratio.sum(), adv < 0, log_ratio.exp())))
    register_estimator(EstimatorSpec("means", lambda rewards, cfg: rewards.mean(dim=1)))
    try:
        with pytest.raises(
            ValueError, match=r"algo.loss=scalar: the surrogate returned shapes \[\(\), \(2,\), \(2,\)\]"
        ):
            policy_loss(inputs([-1.0, -1.0], [1.0, 1.0], [1.0, -1.0]), AlgoConfig(loss="scalar"), 1.0)
        with pytest.raises(ValueError, match=r"algo.name=means: the estimator returned \(1,\), expected .* \(1, 2\)"):
            compute_advantages(torch.tensor([[1.0, 0.0]]), AlgoConfig(name="means"))
    finally:
        unregister_loss("scalar")
        unregister_estimator("means")


def test_a_recipe_with_an_old_flat_loss_key_is_refused_naming_its_section(tmp_path, monkeypatch):
    import shutil

    import rlcore.plan.compose as run
    from rlcore.config import ConfigError

    conf = tmp_path / "conf"
    shutil.copytree(run.CONF_DIR, conf)  # follows conf/recipe's link to recipes/
    (conf / "recipe" / "old.yaml").write_text("# @package _global_\nalgo:\n  loss: dapo\n  dapo_clip_eps_high: 0.3\n")
    (tmp_path / "recipes").mkdir()
    (tmp_path / "recipes" / "old.yaml").write_text("")
    monkeypatch.setattr(run, "CONF_DIR", conf)
    monkeypatch.setattr(run, "RECIPES_DIR", tmp_path / "recipes")
    with pytest.raises(ConfigError, match=r"^algo.dapo_clip_eps_high: moved to algo.dapo.clip_eps_high \(loss dapo's"):
        compose(["+recipe=old"])
