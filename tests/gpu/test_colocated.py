"""One GPU, trainer and vLLM engine colocated (placement=auto resolves to colocated), through the
real CLI: weights over CUDA IPC into the direct receive, canary after every sync, a few
asynchronous steps; then the synchronous hybrid schedule with the engine asleep while the
trainer steps (rollout.vllm.sleep_level=2)."""

import json
import subprocess
import sys

import pytest
import yaml

pytest.importorskip("vllm")

ONE_GPU = [
    "model=qwen3_06b_char",
    "rollout.engine=vllm",
    "trainer.gpus_per_rank=1",
    "rollout.gpus_per_actor=1",
    "cluster.num_gpus=1",
    "trainer.cpus_per_rank=4",
    "rollout.cpus_per_actor=4",
    "+rollout.vllm.engine_kwargs.enforce_eager=true",
    "+rollout.vllm.engine_kwargs.max_model_len=1024",
    "trainer.lr=1e-4",
    "checkpoint.save_final=false",
    "sft.warmup_steps=0",
    "logger.console=false",
]


def run_cli(out, *overrides) -> list[dict]:
    proc = subprocess.run(
        [sys.executable, "-m", "rlcore.run", f"output_dir={out}", *ONE_GPU, *overrides],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert yaml.safe_load((out / "config.yaml").read_text())["placement"] == "colocated"
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def check_rows(rows, steps, staleness):
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for r in rows:
        assert r["canary_max_gap"] < 0.5 and r["canary_mean_gap"] < 0.1, r
        assert r["max_staleness"] <= staleness
        assert r["samples_generated"] == (
            r["samples_trained"]
            + r["samples_dropped_stale"]
            + r["samples_failed"]
            + r["samples_in_flight"]
            + r["samples_filtered"]
        )
        assert r["sync_engine_s"] > 0
    assert rows[-1]["policy_version"] == rows[0]["policy_version"] + steps - 1


@pytest.mark.gpu(gpus=1)
def test_colocated_async_on_one_gpu(tmp_path):
    rows = run_cli(tmp_path / "async", "steps=5", "algo.max_off_policy_steps=1")
    check_rows(rows, 5, staleness=1)


@pytest.mark.gpu(gpus=1)
def test_colocated_sync_with_sleep(tmp_path):
    rows = run_cli(tmp_path / "sleep", "steps=3", "algo.max_off_policy_steps=0", "rollout.vllm.sleep_level=2")
    check_rows(rows, 3, staleness=0)
    assert all(r["sleep_s"] > 0 and r["wake_s"] > 0 for r in rows)
