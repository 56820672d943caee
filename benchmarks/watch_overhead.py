"""Does an open live page slow the run it watches? A/B on the default CPU job.

Each pair runs the default job (`python -m rlcore.run`, the product path) twice, once plain (A)
and once with `logger.watch_port` and a headless Chromium tab open on the page for the whole run
(B: the page polls every 2 s and redraws what changed, as a user's browser does). The page's
own CPU seconds (its server and every browser process) are summed too: on a machine with idle
cores they run beside the job; on a saturated one they compete with it. The order inside a pair alternates (AB, BA, ...) so a load that drifts over the minutes
hits both arms alike. Per run: the median `step_time_s` over the steps after the first 10
(metrics.jsonl) and the load average around it; then the median and range per arm, and the
median of the per-pair ratios B/A.

    uv run python benchmarks/watch_overhead.py --pairs 3 --out watch_overhead.json
    uv run python benchmarks/watch_overhead.py --pairs 2 steps=100   # extra overrides go to both arms
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SKIP_STEPS = 10  # the first steps carry start-up effects (allocator, compile caches)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(run_pid: int, browser_pid: int) -> dict[int, float]:
    """CPU seconds (user + system) so far of the page's server (the run's `rlcore.watch` child)
    and of the browser with all its processes."""
    import psutil

    out = {}
    try:
        server = [c for c in psutil.Process(run_pid).children() if "rlcore.watch" in " ".join(c.cmdline())]
        browser = psutil.Process(browser_pid)
        for p in [*server, browser, *browser.children(recursive=True)]:
            t = p.cpu_times()
            out[p.pid] = t.user + t.system
    except psutil.Error:
        pass
    return out


class RunFailed(RuntimeError):
    """The job did not finish (on a loaded machine: mostly Ray that did not start in time)."""


def one_run(out: Path, page: bool, overrides: list[str]) -> dict:
    """Run the default job into `out`; with `page`, the live page beside it and a browser on it."""
    args = [sys.executable, "-m", "rlcore.run", f"output_dir={out}", "logger.console=false", *overrides]
    browser = None
    port = free_port()
    if page:
        args.append(f"logger.watch_port={port}")
    load_before = os.getloadavg()[0]
    start = time.monotonic()
    log = (out.parent / f"{out.name}.log").open("w")
    proc = subprocess.Popen(args, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    if page:  # the page retries until the server is up, then follows the run
        chromium = shutil.which("chromium") or shutil.which("google-chrome")
        browser = subprocess.Popen(
            [
                chromium,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--no-first-run",
                f"--user-data-dir={out.parent / (out.name + '-profile')}",
                "--window-size=1400,1000",
                "--remote-debugging-port=0",
                f"http://127.0.0.1:{port}/",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    page_cpu = {}  # pid -> CPU seconds last seen, for the page's server and the browser's processes
    try:
        while proc.poll() is None:
            if page:
                page_cpu.update(cpu_seconds(proc.pid, browser.pid))
            time.sleep(5)
            if time.monotonic() - start > 3600:
                raise TimeoutError("the run took over an hour")
        code = proc.returncode
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=60)
        if browser is not None:
            browser.terminate()
            browser.wait(timeout=30)
        log.close()
    wall = time.monotonic() - start
    if code != 0:
        tail = (out.parent / f"{out.name}.log").read_text().strip().splitlines()[-1:]
        raise RunFailed(f"exit code {code}: {tail}")
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step_time_s"] for r in rows if "step_time_s" in r][SKIP_STEPS:]
    return {
        "page": page,
        "exit_code": code,
        "wall_s": wall,
        "steps": len(steps),
        "page_cpu_s": round(sum(page_cpu.values()), 1),
        "step_time_median_s": statistics.median(steps),
        "load_before": load_before,
        "load_after": os.getloadavg()[0],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--out", default=None, help="write the runs and the summary here as JSON")
    p.add_argument("overrides", nargs="*", help="key=value overrides for both arms (default: none)")
    args = p.parse_args()
    if shutil.which("chromium") is None and shutil.which("google-chrome") is None:
        sys.exit("watch_overhead: needs chromium (apt-get install -y chromium)")
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.pairs):
            order = (False, True) if i % 2 == 0 else (True, False)
            for page in order:
                for attempt in range(3):  # a run that failed to start is run again, and said so
                    try:
                        r = one_run(Path(tmp) / f"{i}-{'page' if page else 'plain'}-{attempt}", page, args.overrides)
                        break
                    except RunFailed as exc:
                        print(
                            f"watch_overhead: pair {i} {'page' if page else 'plain'} failed ({exc}); again", flush=True
                        )
                else:
                    sys.exit("watch_overhead: a run failed three times")
                r["pair"] = i
                runs.append(r)
                print(json.dumps(r), flush=True)
    arm = {page: [r["step_time_median_s"] for r in runs if r["page"] == page] for page in (False, True)}
    ratios = [
        next(r for r in runs if r["pair"] == i and r["page"])["step_time_median_s"]
        / next(r for r in runs if r["pair"] == i and not r["page"])["step_time_median_s"]
        for i in range(args.pairs)
    ]
    summary = {
        "overrides": args.overrides,
        "pairs": args.pairs,
        "plain_step_s": {"median": statistics.median(arm[False]), "min": min(arm[False]), "max": max(arm[False])},
        "page_step_s": {"median": statistics.median(arm[True]), "min": min(arm[True]), "max": max(arm[True])},
        "ratio_page_over_plain": {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)},
        "load": [min(r["load_before"] for r in runs), max(r["load_after"] for r in runs)],
    }
    print(json.dumps(summary, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps({"runs": runs, "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
