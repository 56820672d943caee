"""Per-episode cost of the sandbox on CPU: median wall time of one `LocalSandbox.run` of
mini_swe's test runner (and of `python -c pass`), against the same command as a bare subprocess;
then one whole sealed scoring run (`MiniSWE.test_fraction`: the runner, one child per function,
visible and hidden tests), interleaved with a sandboxed `python -c pass`.

    python benchmarks/sandbox_overhead.py [N]
"""

import json
import statistics
import subprocess
import sys
import tempfile
import time

from rlcore.envs.mini_swe import MiniSWE, visible_calls
from rlcore.envs.sealed_tests import SPEC_FILE
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
    task = env.make_task(0, "train")
    spec = json.dumps(
        {
            "nonce": "0" * 32,
            "budget_s": 8.0,  # the runner's spec, as run_sealed writes it
            "calls": [[c.name, c.fn, c.args] for c in visible_calls(task.info["functions"])],
        }
    )
    files = {**task.info["files"], SPEC_FILE: spec}
    sandbox = LocalSandbox(Limits(timeout_s=10))

    def bare_run(cmd, d):
        with open(f"{d}/{SPEC_FILE}", "w") as f:  # the runner deletes it
            f.write(spec)
        subprocess.run(cmd, cwd=d, capture_output=True, check=False)

    for name, cmd in (
        ("python -c pass", [sys.executable, "-c", "pass"]),
        ("mini_swe run_tests.py", [sys.executable, "-I", "run_tests.py"]),
    ):
        boxed = times_s(lambda: sandbox.run(["python", *cmd[1:]], files=files), n)
        with tempfile.TemporaryDirectory() as d:
            for rel, text in files.items():
                open(f"{d}/{rel}", "w").write(text)
            bare = times_s(lambda: bare_run(cmd, d), n)
        print(
            f"{name}: sandboxed {ms(boxed)}, bare {ms(bare)}, overhead "
            f"{(statistics.median(boxed) - statistics.median(bare)) * 1000:.0f} ms (medians of {n}, range in brackets)"
        )
    for functions in (1, 2):
        env = MiniSWE(seed=0, functions=functions, bugs=1)
        task = env.make_task(0, "train")
        fixed = {**task.info["files"], "lib.py": task.info["fixed"]}
        score, empty = [], []
        for _ in range(n):  # interleaved: the box's load hits both alike
            for out, fn in (
                (score, lambda: env.test_fraction(task, fixed)),
                (empty, lambda: sandbox.run(["python", "-c", "pass"])),
            ):
                t = time.perf_counter()
                fn()
                out.append(time.perf_counter() - t)
        print(
            f"sealed score, functions={functions}: median {statistics.median(score) * 1000:.0f} ms "
            f"(range {min(score) * 1000:.0f}-{max(score) * 1000:.0f}); sandboxed `python -c pass` median "
            f"{statistics.median(empty) * 1000:.0f} ms (range {min(empty) * 1000:.0f}-{max(empty) * 1000:.0f}); "
            f"{n} each"
        )


if __name__ == "__main__":
    main()
