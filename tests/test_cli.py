"""Hydra conventions of `python -m rlcore.run`: --help, --cfg job, multirun sweeps."""

import subprocess
import sys

import pytest

from rlcore.plan.cli import FlagError, parse_flags, sweep_jobs
from rlcore.plan.compose import REPO


def run_cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "rlcore.run", *args], cwd=REPO, capture_output=True, text=True, timeout=120
    )


def test_flags_are_split_from_overrides():
    f = parse_flags(["-m", "steps=3", "--cfg", "job", "trainer.lr=1e-3,3e-3"])
    assert (f.multirun, f.print_cfg, f.help) == (True, True, False)
    assert f.overrides == ["steps=3", "trainer.lr=1e-3,3e-3"]
    with pytest.raises(FlagError, match="--cfg"):
        parse_flags(["--cfg", "hydra"])
    with pytest.raises(FlagError, match="--verbose"):
        parse_flags(["--verbose"])


def test_sweeps_expand_to_the_cartesian_product_in_hydra_order():
    jobs = sweep_jobs(["steps=2", "trainer.lr=1e-3,3e-3", "algo.group_size=range(2,6,2)"])
    assert jobs == [
        ["steps=2", "trainer.lr=0.001", "algo.group_size=2"],
        ["steps=2", "trainer.lr=0.001", "algo.group_size=4"],
        ["steps=2", "trainer.lr=0.003", "algo.group_size=2"],
        ["steps=2", "trainer.lr=0.003", "algo.group_size=4"],
    ]
    assert sweep_jobs(["steps=2"]) == [["steps=2"]]


def test_help_lists_groups_and_recipes():
    out = run_cli("--help")
    assert out.returncode == 0, out.stderr
    assert "reverse_text_sft" in out.stdout and "model: " in out.stdout and "--cfg job" in out.stdout


def test_cfg_job_prints_the_composed_config_and_starts_nothing(tmp_path):
    out = run_cli("--cfg", "job", "steps=7", f"output_dir={tmp_path / 'run'}")
    assert out.returncode == 0, out.stderr
    assert "steps: 7" in out.stdout and "rlcore: starting Ray" not in out.stdout + out.stderr
    assert not (tmp_path / "run").exists()


def test_multirun_validates_every_job_before_any_starts(tmp_path):
    out = run_cli("-m", "trainer.lr=1e-3,-1", f"output_dir={tmp_path / 'sweep'}")
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[0].startswith("rlcore: config error: trainer.lr")
    assert not (tmp_path / "sweep").exists()
