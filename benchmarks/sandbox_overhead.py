"""Per-episode cost of the sandbox on CPU: median wall time of one `LocalSandbox.run` of
mini_swe's test runner (and of `python -c pass`), against the same command as a bare subprocess.

    python benchmarks/sandbox_overhead.py [N]
"""

import statistics
import subprocess
import sys
import tempfile
import time

from rlcore.envs.mini_swe import MiniSWE
from rlcore.sandbox import Limits, LocalSandbox


def times_s(fn, n: int) -> list[float]:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return times


def ms(times: list[float]) -> str:
    return f"{statistics.median(times) * 1000:.0f} ms ({min(times) * 1000:.0f}-{max(times) * 1000:.0f})"


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 30
    env = MiniSWE(seed=0, functions=1)
    files = env.make_task(0, "train").info["files"]
    sandbox = LocalSandbox(Limits(timeout_s=10))
    for name, cmd in (("python -c pass", [sys.executable, "-c", "pass"]),
                      ("mini_swe run_tests.py", [sys.executable, "run_tests.py"])):
        boxed = times_s(lambda: sandbox.run(["python", *cmd[1:]], files=files), n)
        with tempfile.TemporaryDirectory() as d:
            for rel, text in files.items():
                open(f"{d}/{rel}", "w").write(text)
            bare = times_s(lambda: subprocess.run(cmd, cwd=d, capture_output=True, check=False), n)
        print(f"{name}: sandboxed {ms(boxed)}, bare {ms(bare)}, overhead "
              f"{(statistics.median(boxed) - statistics.median(bare)) * 1000:.0f} ms (medians of {n}, range in brackets)")


if __name__ == "__main__":
    main()
