"""The shape_count recipe (a vision-language policy) end to end on a local Ray cluster (CPU):
SFT warm-up steps then RL steps through the CLI; images reach the engine and the trainer."""

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration


def test_shape_count_sft_then_rl_through_cli(tmp_path):
    out = tmp_path / "shape_count"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlcore.run",
            "+recipe=shape_count",
            "steps=2",
            "sft.warmup_steps=3",
            "sft.num_examples=48",
            "sft.batch_examples=8",
            "algo.batch_groups=2",
            "algo.group_size=4",
            "rollout.tasks_per_request=2",
            "checkpoint.save_final=false",
            f"output_dir={out}",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in rows if "reward_mean" in r]
    assert [r["step"] for r in rl] == [1, 2]
    assert all(r["batch_samples"] > 0 and r["loss_tokens"] > 0 and r["samples_failed"] == 0 for r in rl)
    # versions continue from the 3 warm-up steps
    assert rl[-1]["policy_version"] == 5
