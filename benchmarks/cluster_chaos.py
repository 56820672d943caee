"""Issue 42's chaos run: the default job on a 4-node local cluster through Ray Jobs, as the README
starts it (driver, trainer, rollout, rollout labels; RAY_max_direct_call_object_size=1024) and
submits it (`launch.submit --deps preinstalled -- ... output_dir=ABSOLUTE`), a clean run first on
the same cluster, then the same job with faults one after another at step marks:

1. the engine's rollout node killed (SIGKILL of its raylet and every process of the node);
2. the other rollout node (where the engine now runs) frozen 30 s (SIGSTOP, then SIGCONT);
3. the trainer node killed, and a replacement node labelled trainer joined at once (as an
   operator or autoscaler replaces a dead machine: the README's cluster has one trainer node);
4. the job's driver process killed (SIGKILL), the job submitted again with resume=true.

    uv run python -m benchmarks.cluster_chaos --steps 40 --out /tmp/rlcore-chaos

It prints every figure with the 1-minute load average: per fault the recovery (fault -> the next
new step row in metrics.jsonl), the whole run against the clean one, and what was lost (samples
failed, steps trained again, the restart/resume lines); it checks steps 1..N once each and the
accounting identity on every row, and exits 1 when either fails. The cluster it started is
stopped at the end (its processes only).

The README's default job saves no checkpoint (`checkpoint.interval=0`): a driver killed then can
only start again from step 1 (resume=true finds rows but no checkpoint and refuses). The job here
adds `checkpoint.interval` (--interval, default 10), the one setting a resubmission needs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from launch import local_cluster as lc
from launch.cluster_nodes import add_node, node_tree

REPO = Path(__file__).resolve().parent.parent
LABELS = ["cluster.trainer_node_labels.rlcore-group=trainer", "cluster.rollout_node_labels.rlcore-group=rollout"]
FREEZE_S = 30.0
SUBMITS: list[subprocess.Popen] = []  # ended with the cluster when the benchmark stops early
LOST_LINES = (
    "no progress for",
    "re-placed",
    "rejoined",
    "restarted the trainer group",
    "trainer restart",
    "optimizer",
    "resumed from",
    "resume:",
    "died",
    "samples in flight",
    "error:",
    "FAILED",
)


def load() -> str:
    return f"load {os.getloadavg()[0]:.1f}"


def say(msg: str) -> None:
    print(f"[chaos {time.strftime('%H:%M:%S', time.gmtime())} UTC, {load()}] {msg}", flush=True)


def signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def rows_of(out: Path) -> list[str]:
    path = out / "metrics.jsonl"
    return [x for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def submit(cluster: lc.Cluster, out: Path, steps: int, interval: int, log: Path, *extra: str) -> subprocess.Popen:
    """The README's submit line (absolute output_dir, the group labels) plus checkpoint.interval."""
    cmd = [
        sys.executable,
        "-m",
        "launch.submit",
        "--address",
        cluster.dashboard_url,
        "--deps",
        "preinstalled",
        "--",
        f"steps={steps}",
        f"output_dir={out}",
        *LABELS,
        f"checkpoint.interval={interval}",
        *extra,
    ]
    say("submit: " + " ".join(cmd[1:]))
    with open(log, "w") as sink:  # the child keeps its own copy of the descriptor
        SUBMITS.append(subprocess.Popen(cmd, cwd=REPO, env=lc.ray_env(), stdout=sink, stderr=subprocess.STDOUT))
    return SUBMITS[-1]


def driver_pid(out: Path) -> int | None:
    """The job's driver: the `python -m rlcore.run ... output_dir=OUT` process (not its shell)."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
            except OSError:
                continue
            if argv[1:3] == ["-m", "rlcore.run"] and f"output_dir={out}" in argv:
                return int(entry.name)
    return None


def placed(log: str, group: str) -> str:
    line = next(ln for ln in log.splitlines() if f"placement: {group} group's" in ln)
    return line.split("on node(s) ")[1].split(",")[0].split()[0]


def node_named(cluster: lc.Cluster, short: str) -> lc.Node:
    return next(n for n in cluster.nodes if n.node_id.startswith(short))


class Fault:
    """One fault: when it struck, the rows before it, and `back`: the rlcore line that says the
    faulty part serves again (looked for in submission `log_index`'s log)."""

    def __init__(self, name: str, rows: list[str], back: str, log_index: int = 0):
        self.name, self.at, self.wall, self.before = name, time.monotonic(), time.time(), set(rows)
        self.back, self.log_index = back, log_index
        self.max_before = max((json.loads(r)["step"] for r in rows), default=0)
        self.recovered_s: float | None = None
        self.next_step = 0
        self.load = load()
        say(f"fault: {name} (after step {self.max_before})")

    def poll(self, rows: list[str], now: float, since: float | None = None) -> None:
        new = [r for r in rows if r not in self.before]
        if self.recovered_s is None and new:
            self.recovered_s = now - (since or self.at)
            self.next_step = json.loads(new[0])["step"]
            say(f"recovered from {self.name}: step {self.next_step} row {self.recovered_s:.1f}s after the fault")

    def retrained(self) -> int:
        return max(0, self.max_before - (self.next_step - 1))


def clean_run(cluster: lc.Cluster, args, root: Path) -> tuple[float, float]:
    out = root / "clean"
    began = time.monotonic()
    proc = submit(cluster, out, args.steps, args.interval, root / "clean.log")
    first = None
    while proc.poll() is None:
        if first is None and rows_of(out):
            first = time.monotonic()
        time.sleep(0.5)
    total, steps_s = time.monotonic() - began, time.monotonic() - (first or began)
    if proc.returncode != 0:
        raise SystemExit(f"clean run failed (exit {proc.returncode}): {(root / 'clean.log').read_text()[-3000:]}")
    say(f"clean run: {total:.1f}s submit -> exit, {steps_s:.1f}s first row -> exit ({len(rows_of(out))} rows)")
    return total, steps_s


def chaos_run(cluster: lc.Cluster, args, root: Path, state: Path) -> dict:
    out, logs = root / "chaos", [root / "chaos-1.log", root / "chaos-2.log"]
    began = time.monotonic()
    proc = submit(cluster, out, args.steps, args.interval, logs[0])
    faults: list[Fault] = []
    frozen: dict = {}
    replacement: dict = {}
    first = None
    mark = args.marks
    appeared: dict[str, float] = {}  # row -> wall time it was first seen
    try:
        while True:
            rows, now = rows_of(out), time.monotonic()
            for r in rows:
                appeared.setdefault(r, time.time())
            first = first or (now if rows else None)
            log = logs[0].read_text()
            for f in faults:
                f.poll(rows, now)
            done = [f for f in faults if f.recovered_s is not None]
            n = len(rows)
            if not faults and n >= mark[0]:
                engine = node_named(cluster, placed(log, "rollout"))
                faults.append(Fault(f"rollout node {engine.node_id[:8]} killed", rows, "rejoined the weight group"))
                signal_all(node_tree(engine), signal.SIGKILL)
                frozen["node"] = next(x for x in cluster.nodes[2:4] if x is not engine)
            elif len(faults) == 1 and len(done) == 1 and n >= mark[1]:
                node = frozen["node"]
                faults.append(
                    Fault(f"rollout node {node.node_id[:8]} frozen {FREEZE_S:.0f}s", rows, "rejoined the weight group")
                )
                frozen["pids"] = node_tree(node)
                signal_all(frozen["pids"], signal.SIGSTOP)
            elif len(faults) == 2 and "back" not in frozen and now - faults[1].at >= FREEZE_S:
                signal_all(frozen["pids"], signal.SIGCONT)
                frozen["back"] = now
                say(f"SIGCONT to the {len(frozen['pids'])} processes of {frozen['node'].node_id[:8]}")
            elif len(faults) == 2 and len(done) == 2 and "back" in frozen and n >= mark[2]:
                trainer = node_named(cluster, placed(log, "trainer"))
                faults.append(Fault(f"trainer node {trainer.node_id[:8]} killed", rows, "restarted the trainer group"))
                signal_all(node_tree(trainer), signal.SIGKILL)

                def replace() -> None:
                    t = time.monotonic()
                    node = add_node(cluster, lc.NodeSpec(cpus=1, labels={"rlcore-group": "trainer"}), timeout_s=400)
                    cluster.save(state.with_suffix(".tmp"))
                    os.replace(state.with_suffix(".tmp"), state)
                    replacement.update(node=node.node_id[:8], s=time.monotonic() - t)
                    say(f"replacement trainer node {node.node_id[:8]} joined in {replacement['s']:.1f}s")

                threading.Thread(target=replace, daemon=True).start()
            elif len(faults) == 3 and len(done) == 3 and n >= mark[3] and (pid := driver_pid(out)):
                faults.append(
                    Fault(
                        f"job driver pid {pid} killed, job resubmitted with resume=true",
                        rows,
                        "resumed from",
                        log_index=1,
                    )
                )
                os.kill(pid, signal.SIGKILL)
                code = proc.wait(timeout=300)
                say(f"the first submission exited {code}")
                proc = submit(cluster, out, args.steps, args.interval, logs[1], "resume=true")
            if proc.poll() is not None:  # finished, or failed (a killed driver is resubmitted above)
                break
            time.sleep(0.5)
    finally:
        signal_all(frozen.get("pids", []), signal.SIGCONT)
    now = time.monotonic()
    return {
        "out": out,
        "logs": logs,
        "faults": faults,
        "code": proc.returncode,
        "total": now - began,
        "steps_s": now - (first or began),
        "replacement": replacement,
        "appeared": appeared,
    }


def stamp(line: str) -> float | None:
    """The wall time of a log line `YYYY-MM-DD HH:MM:SS,mmm ...` (this machine's local time)."""
    try:
        return datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
    except ValueError:
        return None


def seconds(s: float | None) -> str:
    return "never" if s is None else f"{s:.1f}s"


def back_after(f: Fault, chaos: dict) -> tuple[float | None, float | None]:
    """(fault -> its `back` line, fault -> the first row seen after that line), seconds."""
    path = chaos["logs"][f.log_index]
    lines = path.read_text().splitlines() if path.exists() else []
    at = next((t for ln in lines if f.back in ln and (t := stamp(ln)) is not None and t >= f.wall), None)
    if at is None:
        return None, None
    row = min((t for t in chaos["appeared"].values() if t >= at), default=None)
    return at - f.wall, (row - f.wall if row is not None else None)


def report(clean: tuple[float, float], chaos: dict, steps: int) -> bool:
    rows = [json.loads(x) for x in rows_of(chaos["out"])]
    ok_steps = [r["step"] for r in rows] == list(range(1, steps + 1))
    bad = [
        r["step"]
        for r in rows
        if r["samples_generated"]
        != r["samples_trained"]
        + r["samples_dropped_stale"]
        + r["samples_failed"]
        + r["samples_in_flight"]
        + r["samples_filtered"]
    ]
    say(
        f"steps 1..{steps} once each across both submissions: {ok_steps} ({len(rows)} rows); "
        f"accounting identity on every row: {not bad} {bad or ''}"
    )
    say(f"final exit {chaos['code']}; faults injected: {len(chaos['faults'])} of 4")
    steps_by = {r["step"]: r["step_time_s"] for r in rows}
    for f in chaos["faults"]:
        rec = f"{f.recovered_s:.1f}s" if f.recovered_s is not None else "never"
        back, row = back_after(f, chaos)
        longest = max((steps_by.get(s, 0.0) for s in range(f.max_before + 1, f.max_before + 4)), default=0.0)
        say(
            f"  {f.name}: after step {f.max_before}; next row (step {f.next_step}) {rec} after the fault; "
            f"'{f.back}' {seconds(back)}, first row after it {seconds(row)} after the fault; longest of "
            "the 3 steps after it "
            f"{longest:.1f}s; steps trained again {f.retrained()} ({f.load} at the fault)"
        )
    if chaos["replacement"]:
        say(
            f"  replacement trainer node {chaos['replacement']['node']} joined {chaos['replacement']['s']:.1f}s "
            "after the trainer node's kill"
        )
    say(
        f"whole run: chaos {chaos['total']:.1f}s vs clean {clean[0]:.1f}s submit -> exit (+{chaos['total'] - clean[0]:.1f}s); "
        f"first row -> exit {chaos['steps_s']:.1f}s vs {clean[1]:.1f}s (+{chaos['steps_s'] - clean[1]:.1f}s)"
    )
    if rows:
        last = rows[-1]
        say(
            f"lost: samples_failed {last['samples_failed']} (by reason, summed over rows: "
            f"{sum(sum(r['failed_by_reason'].values()) for r in rows)}), samples_dropped_stale "
            f"{last['samples_dropped_stale']}, trainer_restarts {last['trainer_restarts']}, rollout_restarts "
            f"{last['rollout_restarts']}, steps trained again {sum(f.retrained() for f in chaos['faults'])}"
        )
    for i, path in enumerate(chaos["logs"], 1):
        if path.exists():
            text = path.read_text()
            for ln in text.splitlines():
                if any(k in ln for k in LOST_LINES):
                    print(f"  submission {i}: {ln.strip()[:400]}")
            print(f"  submission {i}: {text.count('Traceback')} 'Traceback' in its log")
    return ok_steps and not bad and chaos["code"] == 0 and len(chaos["faults"]) == 4


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--interval", type=int, default=10, help="checkpoint.interval of both runs")
    parser.add_argument(
        "--marks",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[5, 12, 24, 33],
        help="rows logged before each fault: rollout kill, freeze, trainer node kill, driver kill",
    )
    parser.add_argument("--out", type=Path, required=True, help="absolute folder for both runs (made empty)")
    args = parser.parse_args()
    # stopped from outside (even where a background shell ignores SIGINT): stop the cluster first
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    root = args.out.resolve()
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    state = root / "cluster.json"
    cmd = [
        sys.executable,
        "-m",
        "launch.local_cluster",
        "--state",
        str(state),
        "start",
        "--nodes",
        "4",
        "--cpus",
        "1",
        "--env",
        "RAY_max_direct_call_object_size=1024",
        "--timeout",
        "600",
        "--labels",
        "rlcore-group=driver;rlcore-group=trainer;rlcore-group=rollout;rlcore-group=rollout",
    ]
    say("cluster: " + " ".join(cmd[1:]))
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=False)
    print(proc.stdout + proc.stderr, flush=True)
    if proc.returncode != 0:
        return 1
    cluster = lc.Cluster.load(state)
    try:
        clean = clean_run(cluster, args, root)
        chaos = chaos_run(cluster, args, root, state)
        return 0 if report(clean, chaos, args.steps) else 1
    finally:
        for p in SUBMITS:
            if p.poll() is None:
                p.kill()
        lc.stop(cluster)  # the replacement node too: add_node appends it to cluster.nodes
        state.unlink(missing_ok=True)
        say("cluster stopped")


if __name__ == "__main__":
    sys.exit(main())
