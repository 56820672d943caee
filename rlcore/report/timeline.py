"""One timeline of a run's recorded steps (`profile.steps`): the traces every trainer rank and
engine handed back (`{output_dir}/profile/SOURCE/`, see `rlcore.report.profiling`) put on the host's
wall clock, merged into one Chrome trace, and summed up per step and GPU: how long each side's
kernels ran, how long both had kernels at once, how long the GPU had none.

On a GPU that time-slices two processes (no MPS), two processes' kernels never execute at the
same instant: a kernel's recorded span includes the slices the other process got, so "both at
once" is time the two contended for the GPU (each running at a fraction of its speed), and
"idle" is time neither had any kernel queued, which an overlapped schedule exists to fill.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

WINDOWS_FILE = "windows.jsonl"
SOURCE_FILE = "source.json"
MERGED_FILE = "timeline.json.gz"
GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
CPU_CATEGORIES = ("cpu_op", "user_annotation")

Span = tuple[float, float]


@dataclass
class Source:
    """One traced process: its name and role, the physical GPU keys of its CUDA devices 0, 1, ...,
    and its events on the wall clock (microseconds since the epoch)."""

    name: str
    role: str
    host: str
    gpu_keys: list[str]
    events: list[dict[str, Any]] = field(default_factory=list)
    gpu: dict[str, list[Span]] = field(default_factory=dict)  # GPU key -> kernel/copy spans
    cpu: list[Span] = field(default_factory=list)  # CPU op spans (all threads)

    def gpu_spans(self) -> list[Span]:
        return [sp for spans in self.gpu.values() for sp in spans]


def read_json(path: Path) -> Any:
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)


def gpu_key(source: Source, device: Any) -> str:
    """`host GPU n` of local CUDA device `device` (the physical index when CUDA_VISIBLE_DEVICES
    named it, else the local index)."""
    try:
        local = int(device)
    except (TypeError, ValueError):
        local = 0
    physical = source.gpu_keys[local] if 0 <= local < len(source.gpu_keys) else str(local)
    return f"{source.host} GPU {physical}".strip()


def add_trace(source: Source, trace: dict[str, Any]) -> None:
    """Add one Kineto Chrome trace's complete events to `source`, shifted to the wall clock."""
    base_us = float(trace.get("baseTimeNanoseconds", 0)) / 1000.0
    for ev in trace.get("traceEvents", []):
        if "ts" in ev:
            ev = {**ev, "ts": float(ev["ts"]) + base_us}
        source.events.append(ev)
        if ev.get("ph") != "X" or "dur" not in ev:
            continue
        span = (ev["ts"], ev["ts"] + float(ev["dur"]))
        cat = ev.get("cat", "")
        if cat in GPU_CATEGORIES:
            source.gpu.setdefault(gpu_key(source, (ev.get("args") or {}).get("device", 0)), []).append(span)
        elif cat in CPU_CATEGORIES:
            source.cpu.append(span)


def load_sources(profile_dir: str | Path) -> list[Source]:
    """Every `SOURCE/` folder of `profile_dir` with its traces, in name order."""
    out = []
    for folder in sorted(p for p in Path(profile_dir).iterdir() if p.is_dir()):
        meta_path = folder / SOURCE_FILE
        if not meta_path.is_file():
            continue
        meta = read_json(meta_path)
        src = Source(
            meta.get("name", folder.name),
            meta.get("role", "?"),
            meta.get("host", ""),
            [str(g) for g in meta.get("gpus", [])],
        )
        for path in sorted(folder.iterdir()):
            if path.name != SOURCE_FILE and path.name.endswith((".json", ".json.gz")):
                add_trace(src, read_json(path))
        out.append(src)
    return out


def load_windows(profile_dir: str | Path) -> list[dict[str, Any]]:
    path = Path(profile_dir) / WINDOWS_FILE
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# -- interval arithmetic ---------------------------------------------------------------------------


def union(spans: Iterable[Span], lo: float, hi: float) -> list[Span]:
    """The union of `spans` clipped to [lo, hi], as sorted disjoint spans."""
    clipped = sorted((max(a, lo), min(b, hi)) for a, b in spans if b > lo and a < hi)
    out: list[Span] = []
    for a, b in clipped:
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        elif b > a:
            out.append((a, b))
    return out


def length(spans: Iterable[Span]) -> float:
    return sum(b - a for a, b in spans)


def intersection(x: list[Span], y: list[Span]) -> list[Span]:
    """The intersection of two sorted disjoint span lists."""
    out, i, j = [], 0, 0
    while i < len(x) and j < len(y):
        a, b = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        if b > a:
            out.append((a, b))
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return out


def gaps(busy: list[Span], lo: float, hi: float) -> list[Span]:
    """The spans of [lo, hi] that `busy` (sorted, disjoint) leaves free."""
    out, at = [], lo
    for a, b in busy:
        if a > at:
            out.append((at, a))
        at = max(at, b)
    if hi > at:
        out.append((at, hi))
    return out


# -- the summary ------------------------------------------------------------------------------------


def gpu_usage(sources: list[Source], lo: float, hi: float) -> dict[str, dict[str, Any]]:
    """Per GPU key, over [lo, hi] (microseconds): each role's busy time, both at once, idle,
    each process's own busy time and the longest idle gaps (offset from `lo`, length)."""
    out: dict[str, dict[str, Any]] = {}
    keys = sorted({k for s in sources for k in s.gpu})
    for key in keys:
        by_role: dict[str, list[Span]] = {}
        per_source = {}
        for s in sources:
            spans = union(s.gpu.get(key, ()), lo, hi)
            if spans:
                per_source[s.name] = length(spans)
                by_role[s.role] = union(by_role.get(s.role, []) + spans, lo, hi)
        everything = union([sp for spans in by_role.values() for sp in spans], lo, hi)
        roles = {role: length(spans) for role, spans in by_role.items()}
        both = (
            length(intersection(by_role["trainer"], by_role["engine"]))
            if "trainer" in by_role and "engine" in by_role
            else 0.0
        )
        free = sorted(gaps(everything, lo, hi), key=lambda g: g[0] - g[1])[:3]
        out[key] = {
            "roles": roles,
            "both": both,
            "idle": (hi - lo) - length(everything),
            "sources": per_source,
            "longest_gaps": [(a - lo, b - a) for a, b in free],
        }
    return out


def cpu_usage(sources: list[Source], lo: float, hi: float) -> dict[str, float]:
    """Per process without GPU kernels: the time some thread of it ran a CPU op in [lo, hi]."""
    return {s.name: length(union(s.cpu, lo, hi)) for s in sources if not s.gpu and s.cpu}


def _s(us: float) -> str:
    return f"{us / 1e6:.3f}s"


def _pct(part: float, whole: float) -> str:
    return f"{100.0 * part / whole:.0f}%" if whole > 0 else "-"


def summary_lines(sources: list[Source], windows: list[dict[str, Any]]) -> list[str]:
    """The text summary: one block per recorded step."""
    if not windows:
        return ["profile: no recorded step (profile.steps empty, or the run stopped before them)"]
    lines = []
    roles = sorted({s.role for s in sources})
    for w in windows:
        lo, hi = float(w["start_us"]), float(w["end_us"])
        wall = hi - lo
        got = [s.name for s in sources if union(s.gpu_spans(), lo, hi) or union(s.cpu, lo, hi)]
        lines.append(
            f"profile: step {w['step']}, {_s(wall)} from its batch going to the trainer to its weights "
            f"reaching the engines ({len(got)} of {len(sources)} processes recorded in it)"
        )
        usage = gpu_usage(sources, lo, hi)
        for key, u in usage.items():
            parts = [f"{role} kernels {_s(t)} ({_pct(t, wall)})" for role, t in sorted(u["roles"].items())]
            if {"trainer", "engine"} <= set(u["roles"]):
                t, e = u["roles"]["trainer"], u["roles"]["engine"]
                parts.append(
                    f"both at once {_s(u['both'])} ({_pct(u['both'], wall)}), trainer alone "
                    f"{_s(t - u['both'])}, engines alone {_s(e - u['both'])}"
                )
            parts.append(f"idle {_s(u['idle'])} ({_pct(u['idle'], wall)})")
            lines.append(f"  {key}: " + "; ".join(parts))
            if len(u["sources"]) > len(u["roles"]):  # a role with several processes on this GPU
                lines.append(
                    "    by process: " + ", ".join(f"{name} {_s(t)}" for name, t in sorted(u["sources"].items()))
                )
            if u["longest_gaps"]:
                lines.append(
                    "    longest idle gaps: "
                    + ", ".join(f"{g / 1e3:.1f} ms at +{at / 1e6:.3f}s" for at, g in u["longest_gaps"])
                )
        cpu = cpu_usage(sources, lo, hi)
        if cpu:
            lines.append(
                "  CPU ops (processes with no GPU kernels): "
                + ", ".join(f"{name} {_s(t)} ({_pct(t, wall)})" for name, t in sorted(cpu.items()))
            )
        if not usage and not cpu:
            lines.append(f"  nothing recorded in this window (roles present: {', '.join(roles) or 'none'})")
    return lines


def merged_trace(sources: list[Source], windows: list[dict[str, Any]]) -> dict[str, Any]:
    """One Chrome trace of every source (a process row each, named after it; times relative to
    the first window's start) plus a `driver` row of the recorded steps."""
    t0 = min(
        [float(w["start_us"]) for w in windows] + [ev["ts"] for s in sources for ev in s.events if "ts" in ev] or [0.0]
    )
    events: list[dict[str, Any]] = []
    pids: dict[tuple[str, Any], int] = {}
    for s in sources:
        names = {
            ev.get("pid"): (ev.get("args") or {}).get("name")
            for ev in s.events
            if ev.get("ph") == "M" and ev.get("name") == "process_name"
        }
        for ev in s.events:
            if ev.get("ph") not in ("X", "M", "i", "I", "b", "e", "s", "f"):
                continue
            key = (s.name, ev.get("pid"))
            if key not in pids:
                pids[key] = len(pids) + 2
                events.append(
                    {
                        "ph": "M",
                        "name": "process_name",
                        "pid": pids[key],
                        "args": {"name": f"{s.name}: {names.get(ev.get('pid')) or ev.get('pid')}"},
                    }
                )
            if ev.get("ph") == "M" and ev.get("name") == "process_name":
                continue
            out = {**ev, "pid": pids[key]}
            if "ts" in out:
                out["ts"] = out["ts"] - t0
            events.append(out)
    events.append({"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "driver: recorded steps"}})
    for w in windows:
        events.append(
            {
                "ph": "X",
                "name": f"step {w['step']}",
                "cat": "rlcore",
                "pid": 1,
                "tid": 0,
                "ts": float(w["start_us"]) - t0,
                "dur": float(w["end_us"]) - float(w["start_us"]),
            }
        )
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"rlcore": "merged timeline", "origin_epoch_us": t0},
    }


def build(profile_dir: str | Path, write: bool = True) -> list[str]:
    """Read `profile_dir`, write the merged trace next to the sources (unless not `write`) and
    return the summary lines (the last one says where the merged trace is)."""
    profile_dir = Path(profile_dir)
    sources, windows = load_sources(profile_dir), load_windows(profile_dir)
    lines = summary_lines(sources, windows)
    if write and (sources or windows):
        merged = profile_dir / MERGED_FILE
        with gzip.open(merged, "wt") as f:
            json.dump(merged_trace(sources, windows), f)
        lines.append(f"profile: merged timeline {merged} (open it in https://ui.perfetto.dev)")
    return lines
