"""Checkpoint/resume, evaluation and SFT end to end on a local Ray cluster (CPU).

Runs are driven in-process through the same `prepare`/`make_runner` the CLI uses, sharing one
Ray instance (starting Ray is most of a short run's time)."""

import json
from pathlib import Path

import pytest
import torch

from rlcore.plan.compose import compose
from rlcore.plan.validate import validate
from rlcore.report.metrics import MetricsLogger
from rlcore.run import make_runner, prepare

pytestmark = pytest.mark.integration

SYNC = [
    "algo.max_off_policy_steps=0",
    "algo.batch_groups=4",
    "algo.group_size=4",
    # two requests per step run concurrently on the one actor: sampling must not depend on
    # their interleaving
    "rollout.tasks_per_request=2",
    "rollout.sampling.max_new_tokens=8",
    "logger.console=false",
    "eval.every_n_steps=2",
    # an evaluation round that outlasts the next step: its sync must wait for it (issue 54's note)
    "eval.num_tasks=8",
    "eval.max_new_tokens=16",
    "eval.samples_per_task=4",
    "eval.k=[1,4]",
]


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    yield ray
    ray.shutdown()


def run(overrides):
    """One run as `python -m rlcore.run` would do it, minus starting Ray."""
    cfg = compose(overrides)
    validate(cfg)
    runner = make_runner(cfg, prepare(cfg))
    try:
        runner.setup()
        logger = MetricsLogger(cfg.logger, cfg.output_dir, {}, 0 if cfg.mode == "eval" else cfg.steps)
        try:
            return runner.run(logger)
        finally:
            logger.close()
    finally:
        runner.shutdown()


def rows(out: Path, name="metrics.jsonl"):
    return [json.loads(line) for line in (out / name).read_text().splitlines()]


def train_rows(out):
    return {r["step"]: r for r in rows(out) if "loss" in r}


def eval_rows(out):
    return {r["step"]: r for r in rows(out) if "eval/reward_mean" in r}


def test_resume_continues_exactly_where_an_uninterrupted_run_goes(ray_cluster, tmp_path):
    """Synchronous run, 6 steps straight vs 3 steps + resume for 3 more: same task order per
    step, same losses (steps 1-3 show run-to-run determinism, 4-6 exact resume), one metrics
    series, evaluations at the same steps with the same results, each decoded by its step's
    policy alone (default reward isolation); `mode=eval` of the final checkpoint reproduces the
    in-run evaluation."""
    a, b = tmp_path / "a", tmp_path / "b"
    run([*SYNC, f"output_dir={a}", "steps=6"])
    run([*SYNC, f"output_dir={b}", "steps=3"])
    run([*SYNC, f"output_dir={b}", "steps=6", "resume=true"])

    assert rows(a, "data_order.jsonl") == rows(b, "data_order.jsonl")
    ta, tb = train_rows(a), train_rows(b)
    assert [r["step"] for r in rows(b) if "loss" in r] == [1, 2, 3, 4, 5, 6]  # one series, no duplicates
    for step in range(1, 7):
        for key in ("loss", "reward_mean", "entropy", "grad_norm", "policy_version", "samples_trained"):
            assert ta[step][key] == pytest.approx(tb[step][key], rel=1e-6, abs=1e-9), (step, key)
    assert tb[6]["samples_generated"] == ta[6]["samples_generated"]

    ea, eb = eval_rows(a), eval_rows(b)
    assert sorted(ea) == [2, 4, 6] and sorted(eb) == [2, 3, 4, 6]  # b: step 3 was its final step
    for r in [*ea.values(), *eb.values()]:  # every token of a round from its step's policy
        assert r["eval/version_min"] == r["eval/version_max"] == r["eval/policy_version"], r
    for step in (2, 4, 6):
        for key in ("eval/reward_mean", "eval/pass@1", "eval/pass@4"):
            assert ea[step][key] == pytest.approx(eb[step][key], abs=1e-9), (step, key)
    assert [r["step"] for r in rows(b) if "eval/reward_mean" in r].count(3) == 1  # re-run, not duplicated

    records = run([*SYNC, "mode=eval", f"output_dir={tmp_path / 'e'}", f"resume={a / 'checkpoints'}"])
    assert records[0]["step"] == 6
    assert records[0]["eval/reward_mean"] == pytest.approx(ea[6]["eval/reward_mean"], abs=1e-9)
    results = json.loads((tmp_path / "e" / "eval_results.json").read_text())
    assert set(results["environments"]) == {"reverse_text"}


def test_sft_lowers_loss_exports_and_warm_starts_rl(ray_cluster, tmp_path):
    """SFT on a small JSONL chat dataset (reverse_text demonstrations, one malformed row):
    the loss falls; the exported HF dir reloads with transformers with the checkpoint's exact
    logits, works with both tokenizer settings, and an RL run started from it begins with a
    higher reward than one started from the random initialisation."""
    from transformers import AutoModelForCausalLM

    from rlcore.envs import make_env
    from rlcore.models.build import build_model, build_tokenizer
    from rlcore.storage import checkpoint as ckpt

    env = make_env("reverse_text", {"alphabet": "abcdefgh", "min_len": 3, "max_len": 6}, 0)
    data = tmp_path / "chat.jsonl"
    lines = [
        json.dumps({"messages": [*t.messages, {"role": "assistant", "content": t.answer}]})
        for t in (env.make_task(i, "train") for i in range(512))
    ]
    data.write_text("\n".join([lines[0], '{"messages": [', *lines[1:]]) + "\n")
    sft_out = tmp_path / "sft"
    history = run(
        ["+recipe=reverse_text_sft", f"output_dir={sft_out}", f"sft.dataset={data}", "steps=40", "logger.console=false"]
    )
    losses = [h["loss"] for h in history]
    assert sum(losses[-5:]) / 5 < losses[0] - 0.3, losses

    hf = sft_out / "hf"
    final = ckpt.latest_checkpoint(sft_out / "checkpoints")
    assert final is not None and final.name == "step_00000040"
    cfg = compose([])
    ref = build_model(cfg.model, build_tokenizer(cfg.model)).eval()
    ckpt.load_model_weights(ref, final)
    ids = torch.tensor([[1, 10, 11, 12, 2, 1, 7]])
    with torch.no_grad():
        assert torch.equal(AutoModelForCausalLM.from_pretrained(hf).eval()(ids).logits, ref(ids).logits)
    auto = compose([f"model.path={hf}", "model.tokenizer=auto", f"output_dir={tmp_path / 'auto'}"])
    validate(auto)
    assert build_tokenizer(auto.model)("u:abc").input_ids == build_tokenizer(cfg.model)("u:abc").input_ids

    base = run(["+recipe=reverse_text", f"output_dir={tmp_path / 'rl0'}", "steps=1", "logger.console=false"])
    warm = run(
        [
            "+recipe=reverse_text",
            f"output_dir={tmp_path / 'rl1'}",
            "steps=1",
            "logger.console=false",
            f"model.path={hf}",
        ]
    )
    assert warm[0]["reward_mean"] > base[0]["reward_mean"] + 0.1, (base[0]["reward_mean"], warm[0]["reward_mean"])


def test_a_full_disk_while_a_row_is_written_stops_with_one_line_and_resume_reads_every_step_once(
    ray_cluster, tmp_path, capped_disk, monkeypatch
):
    """The disk of `output_dir` (a real 8 MiB tmpfs) fills just before step 3's row: the run stops
    with one error naming metrics.jsonl, "no space left on device" and the resume hint, and leaves
    no half row; with space again, `resume=true` reads back steps 1..4 once, every line JSON."""
    from actors.remote import RunError
    from tests.conftest import fill_disk

    out = capped_disk("8m")
    ckpts = tmp_path / "ckpts"  # checkpoints beside, on a disk with room
    overrides = [*SYNC, "eval.every_n_steps=0", f"output_dir={out}", f"checkpoint.dir={ckpts}", "checkpoint.interval=1"]
    log_row = MetricsLogger.log
    filled = []

    def fill_before_step_3(self, metrics):
        if metrics.get("step") == 3 and not filled:
            filled.append(fill_disk(out))
        return log_row(self, metrics)

    monkeypatch.setattr(MetricsLogger, "log", fill_before_step_3)
    with pytest.raises(RunError) as err:
        run([*overrides, "steps=4"])
    line = str(err.value)
    assert "no space left on device" in line and str(out / "metrics.jsonl") in line, line
    assert "resume=true" in line and len(line.splitlines()) == 1, line
    assert [r["step"] for r in rows(out)] == [1, 2]  # every line parses: no half row
    monkeypatch.setattr(MetricsLogger, "log", log_row)
    filled[0].unlink()
    run([*overrides, "steps=4", "resume=true"])
    assert [r["step"] for r in rows(out) if "loss" in r] == [1, 2, 3, 4]
    assert [r["step"] for r in rows(out, "data_order.jsonl")] == [1, 2, 3, 4]
