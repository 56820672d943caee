"""A verifiers environment never runs the policy's tools on the host by accident (issue 34):
refused in one line before Ray starts unless `env.args.allow_host_tools=true`; `harness.id: null`
is the tool-less loop; a taskset module that fails to import says what failed."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlcore.envs import make_env
from test_verifiers_env import README_TASKSET  # the README's example taskset, one copy

ROOT = Path(__file__).resolve().parents[1]
# a classic (verifiers 0.3.x) environment module: its imports fail under 0.4.0
CLASSIC_ENV = '''
import verifiers as vf
from verifiers.envs.singleturn_env import SingleTurnEnv

def load_environment(**kwargs):
    return SingleTurnEnv(dataset=None)
'''


@pytest.fixture
def tasksets(tmp_path, monkeypatch):
    (tmp_path / "host_calc.py").write_text(README_TASKSET)
    (tmp_path / "classic_vf_env.py").write_text(CLASSIC_ENV)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def _harness(env):
    return type(env.vf_env._harnesses["agent"]).__name__


def test_the_default_bash_harness_on_the_host_is_refused_in_one_line(tasksets):
    with pytest.raises(ValueError) as err:
        make_env("verifiers", {"taskset": "host_calc"}, seed=0)
    text = str(err.value)
    assert text.startswith("env.args.allow_host_tools: ") and "'bash' executes code" in text and "\n" not in text


def test_harness_id_null_is_the_tool_less_loop_in_process(tasksets):
    # what Hydra makes of the README's `env.args.env_config={agent: {harness: {id: null}}}`
    import torch

    from rlcore.engine.base import SamplingParams
    from rlcore.engine.hf_engine import HFEngine
    from rlcore.models.build import build_model, build_tokenizer
    from rlcore.plan.compose import compose

    env = make_env("verifiers", {"taskset": "host_calc", "on_reward_error": "zero",
                                 "env_config": {"agent": {"harness": {"id": None}}}}, seed=0)
    assert _harness(env) == "InProcessChatHarness" and not env.vf_env._harnesses["agent"].EXECUTES_CODE
    cfg = compose([])
    tok = build_tokenizer(cfg.model)
    torch.manual_seed(0)
    engine = HFEngine(build_model(cfg.model, tok), tok.pad_token_id, tok.eos_token_id, seed=0)
    try:
        [group] = env.run_groups([env.make_task(0, "train")], 2, engine, tok, SamplingParams(max_new_tokens=8))
    finally:
        env.close()
    for s in group.samples:  # one model call each, through the endpoint, trained and scored
        assert not s.failed and s.error is None and s.completion_ids and s.loss_mask == [1] * len(s.completion_ids)
        assert s.reward in (0.0, 1.0)


def test_host_tools_on_request_are_warned_about(tasksets, caplog):
    with caplog.at_level("WARNING", logger="rlcore"):
        env = make_env("verifiers", {"taskset": "host_calc", "allow_host_tools": True}, seed=0)
    assert _harness(env) == "BashHarness" and "outside rlcore's sandbox" in caplog.text


def test_a_container_runtime_needs_no_flag(tasksets):
    env = make_env("verifiers", {"taskset": "host_calc", "env_config": {"agent": {"runtime": {"type": "docker"}}}},
                   seed=0)
    assert _harness(env) == "BashHarness"


def test_a_classic_env_says_what_failed_to_import(tasksets):
    with pytest.raises(ValueError) as err:
        make_env("verifiers", {"taskset": "classic_vf_env"}, seed=0)
    text = str(err.value)
    assert "No module named 'verifiers.envs'" in text and "classic_vf_env.py" in text and "not found" not in text
    assert "0.3.x" in text and "\n" not in text


def test_the_cli_refuses_before_ray_starts(tasksets):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tasksets), str(ROOT)])}
    proc = subprocess.run([sys.executable, "-m", "rlcore.run", "env=verifiers", "env.args.taskset=host_calc",
                           f"output_dir={tasksets / 'run'}"], capture_output=True, text=True, timeout=300, env=env,
                          cwd=ROOT, check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "env.args.allow_host_tools" in proc.stderr and "Started a local Ray instance" not in proc.stderr + proc.stdout
