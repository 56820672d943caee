"""The hybrid and vision families through the CLI on a local Ray cluster (CPU), tiny random
configs: a few RL steps each (the engine generates with each layer's own state; the trainer packs
with the recurrent state restarted per sample), the accounting identity on every row, the canary
calibrated on a first sync with no gap; and the refusals a user meets before Ray starts."""

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration

SMALL = [
    "steps=2",
    "sft.warmup_steps=0",
    "algo.batch_groups=2",
    "algo.group_size=4",
    "rollout.tasks_per_request=2",
    "checkpoint.save_final=false",
]
IMAGES = ["+recipe=shape_count", "env.args.image_size=64", "env.args.cell=16"]  # 16-px patches, 2x2 merge
RUNS = {
    "qwen3_next": ["model=tiny_qwen3_next"],  # Gated DeltaNet + attention + MoE with a shared expert
    "nemotron_h": ["model=tiny_nemotron_h"],  # Mamba-2 + attention + MLP
    # vision + hybrid + MoE at once, with routing replay through the image forward
    "qwen3_5_moe": [*IMAGES, "model=tiny_qwen3_5_moe", "rollout.hf.routing_replay=true"],
}
# Qwen3-VL (dense and MoE) and dense Qwen3.5 share this CLI path with qwen3_5_moe; their own model
# code runs in-process in tests/test_vlm_families.py (a CLI run each would add ~45 s apiece)


def run(args, tmp_path, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "rlcore.run", *args, f"output_dir={tmp_path / 'run'}"],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.parametrize("family", list(RUNS))
def test_family_rl_steps_through_cli(family, tmp_path):
    proc = run([*RUNS[family], *SMALL], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["batch_samples"] > 0 and r["loss_tokens"] > 0 and r["samples_failed"] == 0, r
        assert r["samples_generated"] == (
            r["samples_trained"]
            + r["samples_dropped_stale"]
            + r["samples_failed"]
            + r["samples_in_flight"]
            + r.get("samples_filtered", 0)
        ), r
    # trainer and engine compute the same function: the first sync's canary gap is arithmetic only
    assert "canary calibrated" in proc.stdout + proc.stderr
    assert rows[0]["engine_mismatch_kl"] < 1e-3, rows[0]
    if "rollout.hf.routing_replay=true" in RUNS[family]:  # version 0 on both sides: the same experts
        assert rows[0]["moe_replay_agreement"] == 1.0, rows[0]


REFUSED = [
    (["model=tiny_qwen3_next", "trainer.cp=2", "trainer.world_size=2"], "trainer.cp"),
    (["model=tiny_nemotron_h", "trainer.cp=2", "trainer.world_size=2"], "trainer.cp"),
    (["+recipe=shape_count", "model=tiny_qwen3_vl"], "env.args"),  # 56-px images, 32-px windows
]
# routing replay on the vision-language MoE families: no longer refused, on either engine
REPLAY = [
    [*IMAGES, f"model={m}", f"rollout.engine={e}", f"rollout.{e}.routing_replay=true"]
    for m in ("tiny_qwen3_vl_moe", "tiny_qwen3_5_moe")
    for e in ("hf", "vllm")
]


def test_refused_in_one_line_before_ray(tmp_path):
    """Each refusal is the config's only problem (what the CLI prints, one line, exit 2); one of
    them through the CLI itself."""
    from rlcore.plan.compose import compose
    from rlcore.plan.validate import problems

    for args, key in REFUSED:
        found = problems(compose(args))
        assert [k for k, _ in found] == [key], (args, found)
    for args in REPLAY:
        assert not [k for k, _ in problems(compose(args)) if k.endswith("routing_replay")], args
    proc = run(REFUSED[0][0], tmp_path, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("rlcore: config error:")]
    assert len(errors) == 1 and errors[0].startswith("rlcore: config error: trainer.cp: qwen3_next is a hybrid"), errors
    assert "starting Ray" not in proc.stdout + proc.stderr
