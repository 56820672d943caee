"""The live run page as a user sees it: headless Chromium loads it on a CPU run while it trains
(served beside the run by `logger.watch_port`) and on the finished run (`python -m rlcore.watch`),
and what the page shows must be what metrics.jsonl, samples.jsonl and events.jsonl hold.

RLCORE_WATCH_SCREENSHOTS=DIR also saves the README's screenshots (watch_live.png, watch_samples.png)."""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from watch_browser import CHROMIUM, Browser, check_gap_colours  # noqa: E402

if CHROMIUM is None:
    pytest.skip(
        "no Chromium installed (apt-get install -y chromium): the live page's browser tests", allow_module_level=True
    )

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parent.parent
SCREENSHOTS = os.environ.get("RLCORE_WATCH_SCREENSHOTS")
# 20 steps: two evaluations and two checkpoints (every 10 steps), 18 steps for the live page to
# follow after its first 2; the README's screenshots want a longer curve
STEPS = 40 if SCREENSHOTS else 20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def train_rows(out: Path) -> list[dict]:
    return [r for r in rows(out / "metrics.jsonl") if "reward_mean" in r]


def wait(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.5)
    return value


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A default CPU run (shortened) with its page beside it; (process, output dir, page port)."""
    out = tmp_path_factory.mktemp("watch") / "run"
    port = free_port()
    log = (out.parent / "run.log").open("w")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rlcore.run",
            f"steps={STEPS}",
            "sft.warmup_steps=2",
            "logger.samples_every=2",
            "eval.every_n_steps=10",
            "checkpoint.interval=10",
            f"logger.watch_port={port}",
            f"output_dir={out}",
        ],
        cwd=REPO,
        stdout=log,
        stderr=subprocess.STDOUT,
        text=True,
    )
    yield proc, out, port
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=60)
    log.close()


@pytest.fixture
def browser(tmp_path):
    b = Browser(tmp_path / "profile")
    yield b
    b.close()


def page_state(browser: Browser) -> dict:
    return browser.evaluate("""(() => {
        const li = document.querySelector('#runs li');
        const cells = sel => Object.fromEntries([...document.querySelectorAll(sel + ' td[data-key]')]
            .map(td => [td.dataset.key, td.dataset.value === undefined ? td.textContent : Number(td.dataset.value)]));
        return {rows: li ? Number(li.dataset.rows) : 0, ended: li ? li.dataset.ended : null,
                lastStep: li ? li.dataset.lastStep : null, latest: cells('#latest tr[data-run="0"]'),
                accounting: cells('#accounting tr[data-run="0"]'), error: document.body.dataset.error || null,
                points: Object.fromEntries([...document.querySelectorAll('.panel')].map(p => [p.id, Number(p.dataset.points)]))};
    })()""")


def check_latest(state: dict, out: Path) -> dict:
    """The page's latest-step table is the row of that step in metrics.jsonl."""
    by_step = {r["step"]: r for r in train_rows(out)}
    shown = state["latest"]
    row = by_step[shown["step"]]
    keys = [k for k in shown if k != "eval/reward_mean" and isinstance(shown[k], (int, float))]
    assert len(keys) >= 10, shown
    for key in keys:
        assert shown[key] == pytest.approx(row[key], rel=1e-12, abs=0), key
    return row


def test_page_follows_a_live_run_without_reloading(run, browser):
    proc, out, port = run
    wait(lambda: len(train_rows(out)) >= 2 or proc.poll() is not None, 900, "the run never logged 2 steps")
    assert proc.poll() is None, "the run ended before the page could watch it live"
    assert f"rlcore: live page: http://127.0.0.1:{port}/" in (out.parent / "run.log").read_text()
    browser.open(f"http://127.0.0.1:{port}/")
    browser.wait_for(
        "document.querySelector('#runs li') && Number(document.querySelector('#runs li').dataset.rows) > 0"
    )
    browser.evaluate("window.sameDocument = true")
    first = page_state(browser)
    assert first["ended"] == "0" and first["error"] is None
    row = check_latest(first, out)
    assert first["points"]["panel-reward"] >= row["step"] - 1 and first["points"]["panel-busy"] >= 1
    # it updates in place as the run goes on: the same document, later steps
    browser.wait_for(f"Number(document.querySelector('#runs li').dataset.lastStep) >= {row['step'] + 2}", 600)
    assert browser.evaluate("window.sameDocument === true")
    later = page_state(browser)
    assert later["latest"]["step"] > first["latest"]["step"]
    check_latest(later, out)
    if SCREENSHOTS:
        browser.wait_for(f"Number(document.querySelector('#runs li').dataset.lastStep) >= {STEPS // 2}", 600)
        browser.screenshot(Path(SCREENSHOTS) / "watch_live.png")
        browser.evaluate("document.getElementById('samples').scrollIntoView()")
        browser.screenshot(Path(SCREENSHOTS) / "watch_samples.png")


def test_page_shows_a_finished_run_as_its_files_hold_it(run, browser):
    proc, out, _ = run
    assert proc.wait(timeout=1800) == 0, (out.parent / "run.log").read_text()[-3000:]
    page = subprocess.Popen(
        [sys.executable, "-m", "rlcore.watch", str(out), "--port", "0"], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    try:
        line = page.stdout.readline()
        assert line.startswith("rlcore.watch: http://127.0.0.1:"), line
        browser.open(line.split()[1])
        metrics, train = rows(out / "metrics.jsonl"), train_rows(out)
        evals = [r for r in metrics if "eval/reward_mean" in r]
        browser.wait_for(
            f"document.querySelector('#runs li') && document.querySelector('#runs li').dataset.ended === '1'"
            f" && Number(document.querySelector('#runs li').dataset.rows) === {len(metrics)}",
            60,
        )
        state = page_state(browser)
        assert check_latest(state, out) == train[-1] and len(train) == STEPS and evals
        assert state["latest"]["eval/reward_mean"] == pytest.approx(evals[-1]["eval/reward_mean"], rel=1e-12)
        for key in (
            "samples_generated",
            "samples_trained",
            "samples_dropped_stale",
            "samples_failed",
            "samples_in_flight",
        ):
            assert state["accounting"][key] == train[-1][key], key
        assert state["accounting"]["identity"] == "holds"
        assert state["points"]["panel-reward"] == len(train) and state["points"]["panel-eval"] == len(evals)
        check_samples(browser, rows(out / "samples.jsonl"))
        check_timeline(browser, out, evals)
    finally:
        page.terminate()
        page.wait(timeout=30)


def check_samples(browser: Browser, samples: list[dict]) -> None:
    """Every logged sample is shown (newest first) with its reward and its tokens coloured by the
    version that produced each; the reward and step filters select what samples.jsonl selects."""
    assert len(samples) == (STEPS // 2) * 8
    shown = browser.evaluate("""[...document.querySelectorAll('#sample-list .sample')].map(d => ({
        step: Number(d.dataset.step), reward: Number(d.dataset.reward),
        tokens: [...d.querySelectorAll('.tok')].map(t => t.textContent),
        versions: [...d.querySelectorAll('.tok')].map(t => Number(t.dataset.version)),
        colours: new Set([...d.querySelectorAll('.tok')].map(t => t.style.background)).size}))""")
    expected = list(reversed(samples))
    assert [(s["step"], s["reward"]) for s in shown] == [(s["step"], s["reward"]) for s in expected]
    assert [s["tokens"] for s in shown] == [s["tokens"] for s in expected]
    assert [s["versions"] for s in shown] == [s["token_versions"] for s in expected]
    assert len({v for s in samples for v in s["token_versions"]}) > 1  # versions differ: colours tell them apart
    cut = sorted(s["reward"] for s in samples)[len(samples) // 2]
    browser.evaluate(
        f"(() => {{ const e = document.getElementById('f-rmin'); e.value = '{cut}';"
        f" e.dispatchEvent(new Event('input')); }})()"
    )
    assert browser.evaluate("document.querySelectorAll('#sample-list .sample').length") == sum(
        s["reward"] >= cut for s in samples
    )
    step = samples[-1]["step"]
    browser.evaluate(
        f"(() => {{ document.getElementById('f-rmin').value = ''; const e = document.getElementById('f-step');"
        f" e.value = '{step}'; e.dispatchEvent(new Event('input')); }})()"
    )
    assert browser.evaluate(
        "[...document.querySelectorAll('#sample-list .sample')].map(d => Number(d.dataset.step))"
    ) == [step] * sum(s["step"] == step for s in samples)
    check_gap_colours(browser, samples[-1])  # the newest sample of that step comes first


def check_timeline(browser: Browser, out: Path, evals: list[dict]) -> None:
    """Start-up phases (events.jsonl), evaluations (metrics.jsonl), checkpoints (their folders)
    and the end are on the timeline."""
    items = browser.evaluate(
        "[...document.querySelectorAll('#timeline li')].map(li => [li.dataset.kind, li.textContent])"
    )
    events = rows(out / "events.jsonl")
    phases = [e["text"] for e in events if e["kind"] == "phase"]
    assert any("starting Ray" in p for p in phases) and any("first weight sync" in p for p in phases)
    shown = [t for k, t in items if k == "phase"]
    assert len(shown) == len(phases) and all(p in t for p, t in zip(phases, shown))
    assert len([k for k, _ in items if k == "eval"]) == len(evals)
    checkpoints = sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.startswith("step_"))
    assert [t.split("checkpoint ")[-1] for k, t in items if k == "checkpoint"] == checkpoints
    assert [k for k, _ in items][0] == "start" and [k for k, _ in items][-1] == "end"
