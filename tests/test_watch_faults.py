"""What the live page needs of a run that meets faults, on one short CPU run (2 rollout actors, a
reward that fails on some tasks, rollout actor 1 killed with SIGKILL after the first step):
events.jsonl tells of the death and the rejoin, samples.jsonl carries a few failed samples per
reason and the trainer's logprobs of the samples shown, and the page (headless Chromium, when
installed) filters samples by failure reason, colours tokens by the trainer/engine logprob gap
and shows the death and rejoin on its timeline."""

import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_chaos import rollout_actor_pid  # noqa: E402
from watch_browser import CHROMIUM, Browser, check_gap_colours  # noqa: E402

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parent.parent
# the killed actor's restart (a new process, torch, the model) took > 19 s at load 13, while this
# run trained 7 steps (2.7 s each): 8 steps ended before it rejoined. The run is stopped (SIGTERM,
# the graceful stop) once it trained AFTER_REJOIN steps with the actor back, whenever that is:
# STEPS is only a bound it never reaches (it ran 30 fixed steps, most of them after the rejoin)
STEPS = 60
AFTER_REJOIN = 3
# measured on this run (2 shared cores): samples whose every token the trainer scores with the
# weights that sampled it (the engine_mismatch_kl part) differ from the engine's logprobs by
# < 1e-4 (the rows keep 4 decimals: 0.0 measured); samples of the previous version (one step
# stale) by up to 0.6 nats, and so do the later tokens of a sample that a sync reached mid-way
# (0.03: the engine kept the prefix's KV cache of the older weights; the trainer recomputes it)
FRESH_GAP = 2e-3
STALE_GAP = 3.0


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def read(path: Path) -> str:
    return path.read_text() if path.is_file() else ""


def whole_lines(path: Path) -> int:
    """Lines written whole so far to a file another process is appending to."""
    return read(path).count("\n")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The finished run's output folder."""
    out = tmp_path_factory.mktemp("faults") / "run"
    out.mkdir()
    log = out.parent / "run.log"
    killed: list[int] = []
    with log.open("w") as err:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "rlcore.run",
                f"output_dir={out}",
                f"steps={STEPS}",
                "rollout.num_actors=2",
                "rollout.cpus_per_actor=0.5",
                "cluster.num_cpus=2",
                "logger.console=false",
                "logger.samples_every=1",
                "sft.warmup_steps=2",
                "env.name=tests.chaos_env:RaisingReverseText",
            ],
            cwd=REPO,
            stdout=subprocess.DEVNULL,
            stderr=err,
            text=True,
        )

    stopped: list[int] = []  # the rows when the run was sent SIGTERM

    def killer():
        while not killed and proc.poll() is None:
            if rows(out / "metrics.jsonl"):
                pid = rollout_actor_pid(out, 1, None)
                if pid is not None:
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
            time.sleep(0.1)
        rejoined_at = None  # the rows when events.jsonl first told of the rejoin
        while not stopped and proc.poll() is None:
            done = whole_lines(out / "metrics.jsonl")  # files being written: no JSON of a partial line
            if rejoined_at is None and '"kind": "rollout_rejoined"' in read(out / "events.jsonl"):
                rejoined_at = done
            if rejoined_at is not None and done >= rejoined_at + AFTER_REJOIN:
                proc.send_signal(signal.SIGTERM)  # stop after the step in flight
                stopped.append(done)
            time.sleep(0.2)

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    try:
        proc.wait(timeout=900)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=60)
    thread.join(5)
    assert killed, "rollout actor 1 was never killed"
    assert stopped, "the run ended before rollout actor 1 rejoined and trained on: " + log.read_text()[-3000:]
    # stopped by the SIGTERM after the rejoin (a graceful stop at a step boundary), not failed
    assert proc.returncode == 130, log.read_text()[-3000:]
    assert len(rows(out / "metrics.jsonl")) >= stopped[0] >= 1
    return out


def train_rows(out: Path) -> list[dict]:
    return [r for r in rows(out / "metrics.jsonl") if "reward_mean" in r]


def test_events_tell_of_the_rollout_actor_that_died_and_rejoined(run):
    events = rows(run / "events.jsonl")
    died = [e for e in events if e["kind"] == "rollout_died"]
    rejoined = [e for e in events if e["kind"] == "rollout_rejoined"]
    assert [e["actor"] for e in died] == [1], events
    assert [e["actors"] for e in rejoined] == [[1]], events
    assert "rollout actor 1" in died[0]["text"] and "rejoined the weight group" in rejoined[0]["text"]
    assert died[0]["time"] < rejoined[0]["time"] and died[0]["step"] <= rejoined[0]["step"] <= STEPS
    assert rejoined[0]["version"] > died[0]["version"]  # the driver trained on while it restarted
    assert train_rows(run)[-1]["rollout_restarts"] == 1


def test_samples_carry_the_trainer_logprobs_token_by_token(run):
    by_step = {r["step"]: r for r in train_rows(run)}
    scored = [s for s in rows(run / "samples.jsonl") if "failed_reason" not in s]
    assert {s["step"] for s in scored} == set(by_step)
    fresh = 0
    for s in scored:
        trainer = s["trainer_logprobs"]
        assert len(trainer) == len(s["tokens"]) == len(s["token_logprobs"])
        version = by_step[s["step"]]["policy_version"] - 1  # the trainer's weights in that step's forward
        same = s["version"] == version  # the oldest token's version: every token is of the trainer's
        for t, e in zip(trainer, s["token_logprobs"]):
            assert t is not None and math.isfinite(t) and t <= 0
            assert abs(t - e) <= (FRESH_GAP if same else STALE_GAP), (s["step"], s["version"], version, t, e)
            fresh += same
    assert fresh > 0


def test_failed_samples_are_written_by_reason(run):
    failed = [s for s in rows(run / "samples.jsonl") if "failed_reason" in s]
    counted: dict[str, int] = {}
    for r in train_rows(run):
        for reason, n in r["failed_by_reason"].items():
            counted[reason] = counted.get(reason, 0) + n
    reasons = {s["failed_reason"] for s in failed}
    assert any("ValueError: reward bug on" in r for r in reasons) and any("not a number" in r for r in reasons), reasons
    assert reasons <= set(counted)
    for s in failed:
        assert s["reward"] is None and s["prompt"] and s["error"].startswith(s["failed_reason"].split("#")[0])
        if "engine:" not in s["failed_reason"]:  # a reward failure: the completion came back
            assert len(s["tokens"]) == len(s["token_versions"]) >= 1 and "trainer_logprobs" not in s
        else:  # the request was lost with its actor: nothing came back
            assert s["completion"] == "" and "tokens" not in s
    per_step: dict[tuple[int, str], int] = {}
    for s in failed:
        per_step[s["step"], s["failed_reason"]] = per_step.get((s["step"], s["failed_reason"]), 0) + 1
    assert max(per_step.values()) <= 2  # a few per reason and step, not all of them


@pytest.mark.skipif(CHROMIUM is None, reason="no Chromium installed (apt-get install -y chromium)")
def test_the_page_filters_by_reason_colours_the_gap_and_shows_the_rejoin(run, tmp_path):
    page = subprocess.Popen(
        [sys.executable, "-m", "rlcore.watch", str(run), "--port", "0"], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    browser = Browser(tmp_path / "profile")
    try:
        line = page.stdout.readline()
        browser.open(line.split()[1])
        samples = rows(run / "samples.jsonl")
        browser.wait_for(
            f"document.getElementById('samples') !== null"
            f" && document.getElementById('samples').dataset.total === '{len(samples)}'",
            60,
        )
        failed = [s for s in samples if "failed_reason" in s]
        options = browser.evaluate("[...document.getElementById('f-reason').options].map(o => o.value)")
        assert set(options) == {"", "scored"} | {s["failed_reason"] for s in failed}
        for reason in {s["failed_reason"] for s in failed}:
            browser.evaluate(
                f"(() => {{ const e = document.getElementById('f-reason'); e.value = {json.dumps(reason)};"
                f" e.dispatchEvent(new Event('input')); }})()"
            )
            shown = browser.evaluate(
                "[...document.querySelectorAll('#sample-list .sample')].map(d => d.dataset.reason)"
            )
            assert shown == [reason] * sum(s["failed_reason"] == reason for s in failed)
        # the gap mode: each token's title and colour come from |trainer - engine| of the file
        browser.evaluate(
            "(() => { const e = document.getElementById('f-reason'); e.value = 'scored';"
            " e.dispatchEvent(new Event('input')); })()"
        )
        check_gap_colours(browser, [s for s in samples if "failed_reason" not in s][-1])
        kinds = browser.evaluate("[...document.querySelectorAll('#timeline li')].map(li => li.dataset.kind)")
        assert kinds.count("rollout_died") == 1 and kinds.count("rollout_rejoined") == 1
        assert kinds.index("rollout_died") < kinds.index("rollout_rejoined") and "restart" not in kinds
    finally:
        browser.close()
        page.terminate()
        page.wait(timeout=30)
