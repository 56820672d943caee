"""The live run page's parts without a browser: incremental reads, the run's state and implied
events, health alarms, the read-only HTTP server, events.jsonl from the run's start-up phases."""

import io
import json
import logging
import os
import threading
import urllib.error
import urllib.request
from http.server import ThreadingHTTPServer
from pathlib import Path

import pytest

from rlcore.report.events import EventLog, event
from rlcore.report.startup import StartupPhases
from rlcore.report.watch import alarms as alarm_mod
from rlcore.report.watch.alarms import alarms
from rlcore.report.watch.run_view import RunView
from rlcore.report.watch.server import STATIC, make_handler, parse_args
from rlcore.report.watch.tail import JsonlTail


def append(path: Path, *rows, raw: str = "") -> None:
    with path.open("a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
        f.write(raw)


def test_tail_reads_only_new_complete_lines_and_restarts_on_a_cut(tmp_path):
    path = tmp_path / "metrics.jsonl"
    tail = JsonlTail(path)
    assert tail.poll() == ([], False)  # no file yet
    append(path, {"step": 1}, raw='{"step": 2')  # the second line is still being written
    assert tail.poll() == ([{"step": 1}], False)
    offset = tail.offset
    assert tail.poll() == ([], False) and tail.offset == offset
    append(path, raw=', "x": 1}\nnot json\n')
    assert tail.poll() == ([{"step": 2, "x": 1}], False)  # a torn line is skipped, never fatal
    # resume=true cuts the series back by replacing the file: read from the start again
    tmp = tmp_path / "new"
    append(tmp, {"step": 1, "again": True})
    os.replace(tmp, path)
    assert tail.poll() == ([{"step": 1, "again": True}], True)
    with path.open("w"):  # truncated in place
        pass
    append(path, {"step": 9})
    assert tail.poll() == ([{"step": 9}], True)


def test_tail_reads_only_the_bytes_added(tmp_path, monkeypatch):
    path = tmp_path / "m.jsonl"
    append(path, *({"step": i, "pad": "x" * 1000} for i in range(200)))
    tail = JsonlTail(path)
    assert len(tail.poll()[0]) == 200
    reads = []
    real_open = open

    def counting_open(*args, **kwargs):
        f = real_open(*args, **kwargs)
        real_read = f.read
        f.read = lambda n=-1: reads.append(n) or real_read(n)
        return f

    monkeypatch.setattr("builtins.open", counting_open)
    append(path, {"step": 200})
    assert tail.poll() == ([{"step": 200}], False)
    assert reads == [len(json.dumps({"step": 200})) + 1]


def row(step, **kw):
    base = {
        "step": step,
        "reward_mean": 0.5,
        "entropy": 2.0,
        "zero_adv_frac": 0.1,
        "samples_generated": 100 * step,
        "samples_dropped_stale": 0,
        "trainer_busy_frac": 0.9,
        "rollout_busy_frac": 0.8,
        "canary_mean_gap": 0.001,
        "canary_mean_limit": 0.05,
        "canary_max_gap": 0.01,
        "canary_max_limit": 0.5,
    }
    return {**base, **kw}


def test_alarms_are_quiet_on_a_healthy_run():
    assert alarms([row(s) for s in range(1, 41)]) == []


@pytest.mark.parametrize(
    "change,alarm_id",
    [
        (lambda s: {"entropy": 2.0 if s <= 20 else 0.8}, "reward_flat_entropy_collapse"),
        (lambda s: {"canary_mean_gap": 0.04}, "canary_near_bound"),
        (lambda s: {"canary_max_gap": 0.3}, "canary_near_bound"),
        (lambda s: {"zero_adv_frac": 0.8}, "zero_advantage"),
        (lambda s: {"samples_dropped_stale": 0 if s <= 20 else 40 * (s - 20)}, "stale_drops"),
        (lambda s: {"trainer_busy_frac": 0.1}, "idle"),
        (lambda s: {"rollout_busy_frac": 0.2}, "idle"),
    ],
)
def test_each_alarm_fires_on_its_sign(change, alarm_id):
    found = alarms([row(s, **change(s)) for s in range(1, 31)])
    assert [a["id"] for a in found] == [alarm_id] and found[0]["step"] == 30 and found[0]["text"]


def test_entropy_collapse_with_rising_reward_is_no_alarm():
    rows = [row(s, entropy=2.0 if s <= 20 else 0.8, reward_mean=0.2 if s <= 20 else 0.6) for s in range(1, 31)]
    assert alarms(rows) == []
    assert alarm_mod.WINDOW == 10  # the windows compared above are 11-20 and 21-30


def test_run_view_implies_eval_restart_and_checkpoint_events_and_starts_over_on_a_cut(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    append(metrics, row(1, rollout_restarts=0, trainer_restarts=0), row(2, rollout_restarts=1, trainer_restarts=0))
    append(metrics, {"step": 2, "eval/reward_mean": 0.25}, row(3, rollout_restarts=1, trainer_restarts=1))
    EventLog(tmp_path).write("start", "rl run started")
    (tmp_path / "checkpoints" / "step_00000002").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step_00000003.tmp").mkdir()  # not committed: no event
    append(tmp_path / "samples.jsonl", {"step": 2, "prompt": "p", "completion": "c", "reward": 1.0})
    view = RunView(tmp_path)
    p = view.payload(0, 0, 0, 0)
    assert [r["step"] for r in p["rows"]] == [1, 2, 2, 3] and len(p["samples"]) == 1 and not p["ended"]
    kinds = [(e["kind"], e.get("step")) for e in p["events"]]
    assert kinds == [("start", None), ("restart", 2), ("eval", 2), ("restart", 3), ("checkpoint", 2)]
    assert "rollout_restarts 1" in p["events"][1]["text"] and "trainer_restarts 1" in p["events"][3]["text"]
    # a page that holds everything gets nothing again; new lines only
    append(metrics, row(4, rollout_restarts=1, trainer_restarts=1))
    EventLog(tmp_path).write("end", "run ended (exit code 0)", exit_code=0)
    p = view.payload(p["epoch"], 4, 1, 5)
    assert [r["step"] for r in p["rows"]] == [4] and p["samples"] == [] and p["ended"]
    assert [e["kind"] for e in p["events"]] == ["end"]
    # resume=true cut the series back: a new epoch, everything from the start
    tmp = tmp_path / "cut"
    append(tmp, row(1))
    os.replace(tmp, metrics)
    p = view.payload(0, 5, 1, 6)
    assert p["epoch"] == 1 and [r["step"] for r in p["rows"]] == [1] and len(p["samples"]) == 1


def test_fault_lines_tagged_as_events_reach_events_jsonl_and_replace_the_implied_restart(tmp_path):
    """A component's warning with `extra=event(...)` is a timeline event while the run captures
    them; untagged lines are not. The page then takes the restart from events.jsonl and no longer
    implies a second one from the rollout_restarts counter."""
    log = logging.getLogger("rlcore.test_watch")
    events = EventLog(tmp_path)
    with events.capture(logging.getLogger("rlcore")):
        log.warning(
            "rollout actor %d died at version %d", 1, 3, extra=event("rollout_died", actor=1, version=3, step=2)
        )
        log.warning("an ordinary warning")
        log.warning("rollout actor 1 rejoined", extra=event("rollout_rejoined", actors=[1], version=5, step=4))
    log.warning("after the run", extra=event("rollout_died", actor=0, step=9))  # no longer captured
    written = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [(e["kind"], e["text"], e["step"]) for e in written] == [
        ("rollout_died", "rollout actor 1 died at version 3", 2),
        ("rollout_rejoined", "rollout actor 1 rejoined", 4),
    ]
    assert written[1]["actors"] == [1] and written[0]["time"] <= written[1]["time"]
    append(
        tmp_path / "metrics.jsonl", row(1, rollout_restarts=0), row(2, rollout_restarts=1), row(4, rollout_restarts=1)
    )
    kinds = [e["kind"] for e in RunView(tmp_path).payload(0, 0, 0, 0)["events"]]
    assert kinds == ["rollout_died", "rollout_rejoined"]


@pytest.fixture
def server(tmp_path):
    append(tmp_path / "metrics.jsonl", row(1), {**row(2), "loss": float("nan")})
    srv = ThreadingHTTPServer(("127.0.0.1", 0), make_handler([RunView(tmp_path)]))
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def get(url):
    with urllib.request.urlopen(url, timeout=10) as resp:
        return resp.status, resp.headers["Content-Type"], resp.read()


def test_server_serves_the_page_its_assets_and_the_runs(server, tmp_path):
    status, kind, body = get(server + "/")
    assert status == 200 and kind.startswith("text/html") and b"/static/watch.js" in body
    for name in ("uPlot.iife.min.js", "uPlot.min.css", "watch.js", "watch.css"):
        assert get(f"{server}/static/{name}")[2] == (STATIC / name).read_bytes()
    assert (STATIC / "uPlot.LICENSE").read_text().startswith("The MIT License")
    assert json.loads(get(server + "/api/runs")[2]) == [{"index": 0, "name": tmp_path.name, "path": str(tmp_path)}]
    p = json.loads(get(server + "/api/run/0?epoch=0&rows=1")[2])  # strict JSON: a NaN loss is null
    assert [r["step"] for r in p["rows"]] == [2] and p["rows"][0]["loss"] is None


def test_server_is_read_only_and_serves_nothing_else(server):
    for path in ("/api/run/1", "/static/../../run.py", "/static/%2e%2e%2fserver.py", "/metrics.jsonl", "/api/run/x"):
        with pytest.raises(urllib.error.HTTPError) as err:
            get(server + path)
        assert err.value.code == 404, path
    for method in ("POST", "PUT", "DELETE"):
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(urllib.request.Request(server + "/api/runs", data=b"x", method=method), timeout=10)
        assert err.value.code == 501


def test_cli_binds_loopback_by_default_and_refuses_a_missing_folder(tmp_path, capsys):
    from rlcore.report.watch.server import main

    assert parse_args([str(tmp_path)]).host == "127.0.0.1"
    assert main([str(tmp_path / "nope")]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_startup_phases_reach_events_jsonl_as_they_end(tmp_path):
    events = EventLog(tmp_path)
    phases = StartupPhases(stream=io.StringIO(), clock=iter([0.0, 1.5, 2.0, 5.0]).__next__)
    phases.listener = events.phase
    with phases.phase("placing actors"):
        pass
    phases.background("starting the rollout engine").finish()
    lines = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [(x["kind"], x["text"], x["seconds"]) for x in lines] == [
        ("phase", "placing actors", 1.5),
        ("phase", "starting the rollout engine (in the background)", 3.0),
    ]


def test_watch_port_out_of_range_is_one_config_line(tmp_path, capsys):
    from rlcore.run import main

    assert main(["logger.watch_port=70000", f"output_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "logger.watch_port" in err[0] and "[0, 65535]" in err[0]
    assert not (tmp_path / "run").exists()
    from rlcore.plan.compose import compose
    from rlcore.plan.validate import validate

    validate(compose(["logger.watch_port=8765"]))  # a port is a known, valid key
