"""wandb (locked 0.31.0) through its public API only, offline; and the samples table: a few
completions every `logger.samples_every` steps in samples.jsonl and as a wandb.Table."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlcore.batch.meta import group_meta
from rlcore.config import LoggerConfig
from rlcore.report.metrics import MetricsLogger
from rlcore.report.samples import due, sample_rows
from rlcore.types import Group, Sample, Task

REPO = Path(__file__).resolve().parent.parent


def sample(ids, reward, version, failed=False):
    return Sample(
        prompt_ids=[1],
        completion_ids=ids,
        logprobs=[0.0] * len(ids),
        versions=[version] * len(ids),
        loss_mask=[1] * len(ids),
        reward=reward,
        failed=failed,
    )


def groups():
    """Groups as the driver holds them; each one's data handle is its sample list itself."""
    whole = [
        Group(
            task=Task(id="a", messages=[{"role": "system", "content": "s"}, {"role": "user", "content": "abc"}]),
            samples=[sample([3, 2, 1], 1.0, 4), sample([9], 0.0, 3, failed=True)],
        ),
        Group(
            task=Task(id="b", messages=[{"role": "user", "content": "xy"}]),
            samples=[sample([5], 0.5, 4), sample([6, 7], 0.25, 4)],
        ),
    ]
    return [group_meta(g, data=g.samples) for g in whole]


def test_sample_rows_cover_groups_first_and_skip_failed():
    rows = sample_rows(groups(), lambda ids: "".join(map(str, ids)), limit=3)
    tokens = {"tokens", "token_versions", "token_logprobs"}
    assert [{k: v for k, v in r.items() if k not in tokens} for r in rows] == [
        {"prompt": "abc", "completion": "321", "reward": 1.0, "version": 4},
        {"prompt": "xy", "completion": "5", "reward": 0.5, "version": 4},
        {"prompt": "xy", "completion": "67", "reward": 0.25, "version": 4},
    ]
    assert [due(s, 5) for s in (1, 5, 10, 11)] == [False, True, True, False] and not due(5, 0)


def test_sample_rows_carry_each_token_with_its_version_and_engine_logprob():
    """The live page colours each completion token by the policy version that produced it."""
    mixed = Sample(
        prompt_ids=[1],
        completion_ids=[7, 8, 9],
        logprobs=[-0.123456, 0.0, -2.5],
        versions=[3, -1, 4],
        loss_mask=[1, 0, 1],
        reward=0.5,
    )
    [meta] = [
        group_meta(Group(task=Task(id="m", messages=[{"role": "user", "content": "q"}]), samples=[mixed]), data=[mixed])
    ]
    [r] = sample_rows([meta], lambda ids: "".join(f"<{i}>" for i in ids), limit=1)
    assert r["completion"] == "<7><8><9>" and r["tokens"] == ["<7>", "<8>", "<9>"]
    assert r["token_versions"] == [3, -1, 4] and r["token_logprobs"] == [-0.1235, 0.0, -2.5] and r["version"] == 3


def test_sample_rows_fetch_the_token_data_of_the_groups_shown_only():
    fetched = []

    def fetch(handles):
        fetched.append(handles)
        return handles

    batch = groups()
    rows = sample_rows(batch, str, limit=1, fetch=fetch)
    assert [r["completion"] for r in rows] == ["[3, 2, 1]"] and fetched == [[batch[0].data]]


def wandb_runs(out: Path) -> list[Path]:
    return sorted((out / "wandb").glob("offline-run-*"))


def test_wandb_offline_run_and_resume(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    cfg = LoggerConfig(wandb=True, console=False)
    logger = MetricsLogger(cfg, str(tmp_path), {"steps": 3}, 3)
    for step in (1, 2):
        logger.log({"step": step, "reward_mean": 0.1 * step})
    logger.log_samples(2, sample_rows(groups(), str, 4))
    logger.close()
    run_id = (tmp_path / ".wandb_run_id").read_text().strip()
    [run] = wandb_runs(tmp_path)
    assert run.name.endswith(run_id) and (run / f"run-{run_id}.wandb").stat().st_size > 0
    rows = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [2, 2, 2] and rows[0]["completion"] == "[3, 2, 1]"
    # a resumed run continues the same wandb run
    logger = MetricsLogger(cfg, str(tmp_path), {"steps": 3}, 3)
    logger.log({"step": 3, "reward_mean": 0.3})
    logger.close()
    assert (tmp_path / ".wandb_run_id").read_text().strip() == run_id
    # wandb names a run's folder offline-run-<second>-<id>, adding "-1" when the resumed run starts
    # in the same second as the first
    runs = wandb_runs(tmp_path)
    assert len(runs) == 2 and all(f"-{run_id}" in r.name for r in runs), [r.name for r in runs]
    assert all((r / f"run-{run_id}.wandb").stat().st_size > 0 for r in runs)


@pytest.mark.integration
def test_cli_run_with_wandb_offline_logs_samples(tmp_path):
    out = tmp_path / "run"
    env = {**os.environ, "WANDB_MODE": "offline"}
    env.pop("WANDB_API_KEY", None)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlcore.run",
            "steps=2",
            "sft.warmup_steps=0",
            "logger.wandb=true",
            "logger.samples_every=1",
            "logger.samples_per_table=3",
            "checkpoint.save_final=false",
            f"output_dir={out}",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    [run] = wandb_runs(out)
    assert any(run.glob("run-*.wandb"))
    rows = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 1, 1, 2, 2, 2]
    assert all(
        set(r)
        == {
            "step",
            "prompt",
            "completion",
            "reward",
            "version",
            "tokens",
            "token_versions",
            "token_logprobs",
            "trainer_logprobs",
        }
        for r in rows
    )
    assert all(len(r["trainer_logprobs"]) == len(r["tokens"]) for r in rows)
    assert all("".join(r["tokens"]) == r["completion"] and len(r["tokens"]) == len(r["token_versions"]) for r in rows)
    assert all(isinstance(r["completion"], str) and r["prompt"] for r in rows)
