"""What the chaos of issue 22 costs a run: the default job clean (A) against the same job with
rewards that raise, hang, busy-loop, return junk and print megabytes, and rollout actor 1 killed
(SIGKILL) twice (B), each a whole `python -m rlcore.run` process timed from start to exit (the
jobs of tests/test_chaos.py, run by its own `run_job`). The order inside a pair alternates (AB,
BA, ...) so a load that drifts hits both arms alike. Prints each run's seconds and load, then
the median and range of the per-pair ratios B/A. The issue's bound: 2x.

    uv run python benchmarks/chaos_overhead.py --pairs 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.test_chaos import REWARD_TIMEOUT_S, run_job  # noqa: E402  (the test's jobs, not a copy)

CHAOS = ["env.name=tests.chaos_env:ChaosReverseText", f"env.reward.timeout_s={REWARD_TIMEOUT_S}"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=3, help="clean/chaos pairs (default 3)")
    args = ap.parse_args()
    ratios = []
    with tempfile.TemporaryDirectory(prefix="chaos-bench-") as tmp:
        for pair in range(args.pairs):
            took = {}
            for arm in ("clean", "chaos") if pair % 2 == 0 else ("chaos", "clean"):
                load = os.getloadavg()[0]
                kill = {"kill_at": 2, "kills": 2} if arm == "chaos" else {}
                took[arm], _, _ = run_job(Path(tmp) / f"{pair}", arm, CHAOS if arm == "chaos" else [], **kill)
                print(
                    f"pair {pair + 1} {arm}: {took[arm]:.1f}s (load {load:.1f} -> {os.getloadavg()[0]:.1f})", flush=True
                )
            ratios.append(took["chaos"] / took["clean"])
    print(
        f"chaos/clean over {len(ratios)} pair(s): median {statistics.median(ratios):.2f}x, "
        f"range {min(ratios):.2f}-{max(ratios):.2f}x"
    )


if __name__ == "__main__":
    main()
