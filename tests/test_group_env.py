"""Per-group process environment (`trainer.env_vars`, `rollout.env_vars`, `teacher.env_vars`) and the
vLLM engine's extra sampling parameters (`rollout.vllm.sampling_kwargs`): refused before Ray
starts where rlcore owns the name, and carried to the actors and the engine otherwise."""

from __future__ import annotations

import pytest

from actors.actor_config import CONFIG_ENV, config_env
from rlcore.engine.vllm.vllm_model_dir import engine_args
from rlcore.plan.compose import compose
from rlcore.plan.validate import problems
from rlcore.run import main

GPU = ["trainer.gpus_per_rank=1", "rollout.engine=vllm", "rollout.gpus_per_actor=1"]


@pytest.mark.parametrize(
    "overrides,key,text",
    [
        (
            [*GPU, "+rollout.vllm.sampling_kwargs.max_tokens=8"],
            "rollout.vllm.sampling_kwargs.max_tokens",
            "rollout.sampling.max_new_tokens",
        ),
        (
            [*GPU, "+rollout.vllm.sampling_kwargs.logprobs=5"],
            "rollout.vllm.sampling_kwargs.logprobs",
            "the engine sets it",
        ),
        ([*GPU, "+rollout.vllm.sampling_kwargs.seed=3"], "rollout.vllm.sampling_kwargs.seed", "rollout.request_seeds"),
        (["+rollout.vllm.sampling_kwargs.ignore_eos=true"], "rollout.vllm.sampling_kwargs", "rollout.engine=vllm"),
        (["+trainer.env_vars.CUDA_VISIBLE_DEVICES=0"], "trainer.env_vars.CUDA_VISIBLE_DEVICES", "Ray assigns"),
        (["+rollout.env_vars.RLCORE_ACTOR_CONFIG=x"], "rollout.env_vars.RLCORE_ACTOR_CONFIG", "rlcore's own"),
        (["+teacher.env_vars.BAD-NAME=1"], "teacher.env_vars.BAD-NAME", "not an environment variable name"),
        (["+rollout.env_vars.PYTHONPATH=/x"], "rollout.env_vars.PYTHONPATH", "import path"),
    ],
)
def test_owned_names_are_refused_naming_the_key(overrides, key, text, capsys, tmp_path):
    assert main([*overrides, f"output_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"rlcore: config error: {key}") and text in err[0], err


def test_sampling_kwargs_reach_the_engine_arguments():
    cfg = compose([*GPU, "+rollout.vllm.sampling_kwargs.ignore_eos=true", "+rollout.vllm.sampling_kwargs.min_p=0.05"])
    assert problems(cfg) == []
    _, kwargs = engine_args(cfg.rollout.vllm, cfg.model)
    assert kwargs["extra_sampling"] == {"ignore_eos": True, "min_p": 0.05}
    _, plain = engine_args(compose(GPU).rollout.vllm, compose(GPU).model)
    assert "extra_sampling" not in plain


def test_group_env_vars_join_the_actor_runtime_env():
    cfg = compose(
        [
            "+rollout.env_vars.CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=40",
            "+rollout.env_vars.NCCL_NVLS_ENABLE=1",
            "+trainer.env_vars.OMP_NUM_THREADS=2",
        ]
    )
    assert problems(cfg) == []
    rollout = config_env(cfg, cfg.rollout.env_vars)["env_vars"]
    assert rollout["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "40"
    assert rollout["NCCL_NVLS_ENABLE"] == "1"  # a group's own setting wins over rlcore's default
    assert CONFIG_ENV in rollout and "OMP_NUM_THREADS" not in rollout
    trainer = config_env(cfg, cfg.trainer.env_vars)["env_vars"]
    assert trainer["OMP_NUM_THREADS"] == "2" and "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in trainer
    assert all(isinstance(v, str) for v in trainer.values())  # Ray takes strings only
