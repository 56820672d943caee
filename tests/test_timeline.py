"""The run timeline (`profile.steps`, `python -m rlcore.timeline`): traces of several processes
put on one wall clock, each GPU's time split into trainer / engines / both / idle; the config
checks; a real torch.profiler trace read back."""

import gzip
import json
import subprocess
import sys
import time

import pytest

from rlcore.config import RunConfig
from rlcore.report import timeline
from rlcore.report.profiling import TraceRecorder, config_problems

BASE_NS = 1_700_000_000_000_000_000  # the traces' baseTimeNanoseconds: event ts are microseconds after it
START_US = BASE_NS / 1000


def kineto(kernels, base_ns=BASE_NS, device=0):
    """A Kineto-shaped Chrome trace with a GPU kernel per (start, duration) in microseconds after
    the base time, and one CPU op."""
    events = [
        {"ph": "M", "name": "process_name", "pid": 7, "args": {"name": "python3"}},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 7, "tid": 7, "ts": 0.0, "dur": 5.0},
    ]
    events += [
        {
            "ph": "X",
            "cat": "kernel",
            "name": "gemm",
            "pid": device,
            "tid": 7,
            "ts": float(a),
            "dur": float(d),
            "args": {"device": device, "stream": 7},
        }
        for a, d in kernels
    ]
    return {"baseTimeNanoseconds": base_ns, "traceEvents": events}


def write_source(folder, name, role, trace, gpus=("3",), host="node-a"):
    folder.mkdir(parents=True)
    (folder / "source.json").write_text(json.dumps({"name": name, "role": role, "host": host, "gpus": list(gpus)}))
    with gzip.open(folder / "step1.json.gz", "wt") as f:
        json.dump(trace, f)


@pytest.fixture
def profile_dir(tmp_path):
    """One step of 1000 us: trainer kernels 0-300 and 500-600, engine kernels 200-400 and 900-950
    (the engine's trace has a base 100 us later, so its ts are 100 less), both on physical GPU 3."""
    d = tmp_path / "profile"
    write_source(d / "trainer0", "trainer rank 0", "trainer", kineto([(0, 300), (500, 100)]))
    write_source(d / "engine0", "engine 0", "engine", kineto([(100, 200), (800, 50)], base_ns=BASE_NS + 100_000))
    (d / "windows.jsonl").write_text(json.dumps({"step": 1, "start_us": START_US, "end_us": START_US + 1000}) + "\n")
    return d


def test_interval_arithmetic():
    assert timeline.union([(5, 9), (0, 3), (2, 4), (20, 30)], 1, 25) == [(1, 4), (5, 9), (20, 25)]
    assert timeline.intersection([(0, 4), (6, 10)], [(3, 7)]) == [(3, 4), (6, 7)]
    assert timeline.gaps([(2, 4), (6, 8)], 0, 10) == [(0, 2), (4, 6), (8, 10)]
    assert timeline.length([(0, 2), (5, 6)]) == 3


def test_gpu_time_split_on_one_clock(profile_dir):
    sources = timeline.load_sources(profile_dir)
    usage = timeline.gpu_usage(sources, START_US, START_US + 1000)
    assert list(usage) == ["node-a GPU 3"]  # local device 0 is physical GPU 3 in both processes
    u = usage["node-a GPU 3"]
    assert u["roles"] == {"trainer": 400.0, "engine": 250.0}
    assert u["both"] == 100.0  # trainer 0-300 and engine 200-400 (its base is 100 us later)
    assert u["idle"] == 1000 - (400 + 250 - 100)
    assert u["longest_gaps"][0] == (600.0, 300.0)  # 600-900: nobody had a kernel
    lines = timeline.summary_lines(sources, timeline.load_windows(profile_dir))
    assert lines[0].startswith("profile: step 1, 0.001s") and "(2 of 2 processes recorded in it)" in lines[0]
    assert "both at once 0.000s (10%)" in lines[1] and "idle 0.000s (45%)" in lines[1]


def test_merged_trace_puts_every_process_on_one_timeline(profile_dir):
    lines = timeline.build(profile_dir)
    assert lines[-1].startswith("profile: merged timeline ")
    with gzip.open(profile_dir / timeline.MERGED_FILE, "rt") as f:
        merged = json.load(f)
    names = {e["args"]["name"] for e in merged["traceEvents"] if e.get("name") == "process_name"}
    assert {"trainer rank 0: python3", "engine 0: python3", "driver: recorded steps"} <= names
    kernels = sorted((e["ts"], e["dur"]) for e in merged["traceEvents"] if e.get("cat") == "kernel")
    assert kernels[:3] == [(0.0, 300.0), (200.0, 200.0), (500.0, 100.0)]  # relative to the step's start
    step = [e for e in merged["traceEvents"] if e.get("name") == "step 1"]
    assert step and step[0]["ts"] == 0.0 and step[0]["dur"] == 1000.0


def test_cli_summary_and_errors(profile_dir, tmp_path):
    run = [sys.executable, "-m", "rlcore.timeline"]
    done = subprocess.run(run + [str(profile_dir.parent)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("profile: step 1, ") and "node-a GPU 3: " in done.stdout
    missing = subprocess.run(run + [str(tmp_path / "nothing")], capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2 and "profile.steps" in missing.stderr and "Traceback" not in missing.stderr
    (profile_dir / "trainer0" / "step1.json.gz").write_bytes(b"not gzip")
    broken = subprocess.run(run + [str(profile_dir)], capture_output=True, text=True, timeout=120)
    assert broken.returncode == 1 and "cannot read the traces" in broken.stderr and "Traceback" not in broken.stderr


def test_recorder_trace_reads_back_on_the_wall_clock(tmp_path):
    """A real torch.profiler trace (CPU ops here) lands inside the wall-clock window it was taken in."""
    import torch

    recorder = TraceRecorder()
    start_us = time.time_ns() / 1000
    recorder.start("step1")
    x = torch.randn(64, 64)
    for _ in range(5):
        x = x @ x / 64
    files = recorder.stop()
    end_us = time.time_ns() / 1000
    assert [name for name, _ in files] == ["step1.json.gz"]
    src = timeline.Source("trainer rank 0", "trainer", "", [])
    timeline.add_trace(src, json.loads(gzip.decompress(files[0][1])))
    mm = [ev for ev in src.events if ev.get("name") == "aten::mm"]
    assert mm and all(start_us - 1000 <= ev["ts"] <= end_us + 1000 for ev in mm)  # clocks agree within 1 ms
    assert timeline.cpu_usage([src], start_us, end_us)["trainer rank 0"] > 0
    assert recorder.stop() == []  # nothing started since


@pytest.mark.parametrize(
    "overrides,key,says",
    [
        (dict(steps=5, profile_steps=[6]), "profile.steps", "in 1..5"),
        (dict(steps=5, profile_steps=[0]), "profile.steps", "not a step of this run"),
        (dict(steps=5, profile_steps=[2, 2]), "profile.steps", "twice"),
        (dict(steps=5, profile_steps=[2], mode="sft"), "profile.steps", "mode=sft"),
    ],
)
def test_config_problems_name_the_key(overrides, key, says):
    cfg = RunConfig(steps=overrides["steps"], mode=overrides.get("mode", "rl"))
    cfg.profile.steps = overrides["profile_steps"]
    found = config_problems(cfg)
    assert found and found[0][0] == key and says in found[0][1], found
    cfg.profile.steps = [1, 5]
    assert config_problems(RunConfig(steps=5)) == []


def test_cli_refuses_bad_steps_before_ray(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "rlcore.run", "steps=3", "profile.steps=[4]", f"output_dir={tmp_path / 'run'}"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert "profile.steps" in done.stderr and "Traceback" not in done.stderr and "starting Ray" not in done.stdout


def test_several_processes_of_a_role_on_one_gpu_are_listed(profile_dir):
    write_source(profile_dir / "engine1", "engine 1", "engine", kineto([(700, 100)]))
    lines = timeline.summary_lines(timeline.load_sources(profile_dir), timeline.load_windows(profile_dir))
    assert "    by process: engine 0 0.000s, engine 1 0.000s, trainer rank 0 0.000s" in lines
    usage = timeline.gpu_usage(timeline.load_sources(profile_dir), START_US, START_US + 1000)["node-a GPU 3"]
    assert usage["roles"]["engine"] == 350.0 and usage["sources"]["engine 1"] == 100.0
