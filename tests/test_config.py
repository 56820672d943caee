"""Bad config gives one clear line naming the key and exit code 2, before Ray starts."""

import subprocess
import sys

import pytest

from rlcore.config.errors import ConfigError
from rlcore.plan.compose import compose
from rlcore.plan.validate import problems, validate
from rlcore.run import main

BAD = [
    (["trainer.lr=-1"], "trainer.lr"),
    (["trainer.world_size=0"], "trainer.world_size"),
    (["trainer.lr=abc"], "trainer.lr"),
    (["trainer.no_such_key=1"], "trainer.no_such_key"),
    (["+recipe=does_not_exist"], "recipe"),
    (["rollout.engine=tgi"], "rollout.engine"),
    (["rollout.sampling.top_p=1.5"], "rollout.sampling.top_p"),
    (["algo.group_size=1"], "algo.group_size"),
    (["algo.loss=nope"], "algo.loss"),
    (["algo.max_off_policy_steps=-1"], "algo.max_off_policy_steps"),
    (["env.name=nope"], "env.name"),
    (["env.args.min_len=9"], "env.args.min_len"),
    (["env.args.bogus=1"], "env.args"),
    (["model.path=/nonexistent/model"], "model.path"),
    (["trainer.world_size=64"], "trainer.cpus_per_rank"),
    (["rollout.gpus_per_actor=4"], "trainer.gpus_per_rank"),
    (["rollout.engine=vllm"], "rollout.gpus_per_actor"),
    (["trainer.logprob_keep_logits_gib=-1"], "trainer.logprob_keep_logits_gib"),
]


@pytest.mark.parametrize("overrides,key", BAD)
def test_bad_config_names_the_key(overrides, key, capsys, tmp_path):
    assert main([*overrides, f"output_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith(f"rlcore: config error: {key}"), err[0]


def test_default_config_is_valid(tiny_cfg):
    assert problems(tiny_cfg) == []
    validate(tiny_cfg)


def test_gpu_model_preset_is_the_benchmark_shape():
    """`model=qwen3_06b_char` (the GPU scripts' and GPU tests' policy) is the Qwen3-0.6B shape the
    throughput and weight-sync benchmarks build, over the character vocabulary."""
    from benchmarks.harness import MODEL_SHAPES

    cfg = compose(
        ["model=qwen3_06b_char", "trainer.gpus_per_rank=1", "rollout.engine=vllm", "rollout.gpus_per_actor=1"]
    )
    shape = {k: v for k, v in MODEL_SHAPES["qwen3-0.6b"].items() if k != "vocab_size"}
    assert {k: cfg.model.arch[k] for k in shape} == shape
    assert cfg.model.tokenizer == "char" and cfg.model.path is None
    assert problems(cfg) == []


def test_recipe_and_overrides_compose():
    cfg = compose(["+recipe=reverse_text", "steps=7", "trainer.lr=0.01"])
    assert cfg.recipe == "reverse_text" and cfg.steps == 7 and cfg.trainer.lr == 0.01


def test_config_error_names_key():
    err = ConfigError("trainer.lr", "must be > 0")
    assert str(err) == "trainer.lr: must be > 0" and err.key == "trainer.lr"


def test_cli_exit_code_and_no_traceback():
    proc = subprocess.run(
        [sys.executable, "-m", "rlcore.run", "algo.group_size=abc"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().startswith("rlcore: config error: algo.group_size")
