"""Figures of docs/scale_out.md: start-up of a local cluster per node count, and the default job's
steps per second on 1 node vs 3 nodes of this machine (same CPUs in all).

    python -m benchmarks.scale_out startup --nodes 1,2,4
    python -m benchmarks.scale_out steps --steps 30

Each figure is printed with the load average (1 min) before and after it: this machine is shared.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from launch import local_cluster as lc

REPO = Path(__file__).resolve().parent.parent


def load() -> str:
    return f"{os.getloadavg()[0]:.1f}"


def startup(counts: list[int]) -> None:
    for n in counts:
        before = load()
        cluster = lc.start([lc.NodeSpec(cpus=1) for _ in range(n)], timeout_s=600)
        try:
            print(f"startup nodes={n}: {cluster.started_s:.1f} s (load {before} -> {load()})", flush=True)
        finally:
            lc.stop(cluster)


def steps(n_steps: int) -> None:
    layouts = {
        "1 node (3 CPUs)": ([lc.NodeSpec(cpus=3)], []),
        "3 nodes (1 CPU each: driver, trainer, rollout)": (
            [lc.NodeSpec(cpus=1, labels={"rlcore-group": g}) for g in ("driver", "trainer", "rollout")],
            ["cluster.trainer_node_labels.rlcore-group=trainer", "cluster.rollout_node_labels.rlcore-group=rollout"],
        ),
    }
    for name, (specs, overrides) in layouts.items():
        cluster = lc.start(specs, timeout_s=600)
        try:
            out = Path(tempfile.mkdtemp(prefix="scale-out-"))
            before = load()
            proc = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "rlcore.run",
                    f"cluster.address={cluster.gcs_address}",
                    f"output_dir={out / 'run'}",
                    f"steps={n_steps}",
                    *overrides,
                ],
                cwd=REPO,
                capture_output=True,
                text=True,
                timeout=1200,
                env=lc.ray_env(),
            )
            if proc.returncode != 0:
                raise SystemExit(f"{name}: run failed: {proc.stderr[-2000:]}")
            rows = [json.loads(x) for x in (out / "run" / "metrics.jsonl").read_text().splitlines()]
            times = [r["step_time_s"] for r in rows[1:]]  # step 1 includes the first generation
            print(
                f"steps {name}: {len(rows)} steps, {1 / statistics.mean(times):.2f} steps/s (median step "
                f"{statistics.median(times):.2f} s, mean {statistics.mean(times):.2f} s; load {before} -> {load()})",
                flush=True,
            )
        finally:
            lc.stop(cluster)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scale_out")
    sub = parser.add_subparsers(dest="what", required=True)
    s = sub.add_parser("startup")
    s.add_argument("--nodes", default="1,2,4")
    t = sub.add_parser("steps")
    t.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    if args.what == "startup":
        startup([int(x) for x in args.nodes.split(",")])
    else:
        steps(args.steps)


if __name__ == "__main__":
    main()
