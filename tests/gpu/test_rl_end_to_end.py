"""Async RL end to end on two GPUs through the real CLI: trainer (FSDP2) on one GPU, a vLLM
engine on the other, weights over vLLM's NCCL weight transfer, canary after every sync.
The same configuration as `benchmarks/gpu_e2e.sh` (whose run is recorded in docs/benchmarks.md)."""

import json
import subprocess
import sys

import pytest

pytest.importorskip("vllm")

QWEN3_0P6B_SHAPE = ["model=qwen3_06b_char"]  # conf/model/qwen3_06b_char.yaml
TWO_GPUS = [
    "trainer.gpus_per_rank=1",
    "trainer.cpus_per_rank=4",
    "rollout.engine=vllm",
    "rollout.gpus_per_actor=1",
    "rollout.cpus_per_actor=4",
    "+rollout.vllm.engine_kwargs.enforce_eager=true",
    "+rollout.vllm.engine_kwargs.gpu_memory_utilization=0.6",
    "+rollout.vllm.engine_kwargs.max_model_len=1024",
    "trainer.lr=1e-4",
    "checkpoint.save_final=false",
    "sft.warmup_steps=0",
    "logger.console=false",
]


@pytest.mark.gpu(gpus=2)
def test_async_rl_with_vllm_and_canary(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlcore.run",
            "steps=6",
            "algo.max_off_policy_steps=1",
            f"output_dir={out}",
            *QWEN3_0P6B_SHAPE,
            *TWO_GPUS,
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 7))
    for r in rows:
        assert r["canary_max_gap"] < 0.5 and r["canary_mean_gap"] < 0.1
        assert r["max_staleness"] <= 1
        assert r["samples_generated"] == (
            r["samples_trained"]
            + r["samples_dropped_stale"]
            + r["samples_failed"]
            + r["samples_in_flight"]
            + r["samples_filtered"]
        )
    assert rows[-1]["policy_version"] == rows[0]["policy_version"] + 5
