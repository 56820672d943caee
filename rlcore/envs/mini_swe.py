"""mini_swe: fix a small Python repository so its tests pass, using file and test tools.

Each task is a generated repo: `lib.py` with a few functions, some carrying a planted bug, and
`test_lib.py` with plain-assert tests, plus a tiny stdlib test runner (`run_tests.py`, prints
one JSON line). The repo lives in the episode state (a dict of files); tools act on it:

    <tool>ls:</tool>                   list files
    <tool>read: PATH</tool>            a file's content
    <tool>write: PATH
    CONTENT</tool>                     replace a file (test files and the runner are read-only)
    <tool>run: tests</tool>            run the tests in the sandbox; their summary

Code only ever runs in a :class:`rlcore.sandbox.Sandbox` (`sandbox` arg: `local` or
`module:Class` for a cluster's container sandbox). Reward = fraction of tests passing when the
*original* tests run against the agent's final files (editing tests cannot game it).

Demonstrations (supervised warm-up): a scripted agent that reads lib.py, writes it back with
every function in its correct form, runs the tests, and stops ("done", no tool call). Its
episodes are played against this environment, so the test run really happens in the sandbox.
`demo_noise` weakens it: with that probability (fixed per task) it writes lib.py back as it read
it, bug included, and loses; a policy imitating it leaves RL something to learn: make the fix.
`functions` sets the difficulty: the `mini_swe` recipe uses 1 (one short function per repo,
a one-line bug, whole episodes of 430-545 characters), which the tiny CPU policy can learn.
"""

from __future__ import annotations

import importlib
import json
import random
from typing import Any

from rlcore.envs.base import Message, register, rng_for
from rlcore.envs.tools import ToolEnvironment
from rlcore.sandbox import Limits, LocalSandbox, Sandbox, check_relative
from rlcore.sandbox.local import SandboxUnavailable
from rlcore.types import Task

# (name, correct source, buggy source, tests): each test is one assert line
FUNCTIONS = [
    ("add", "def add(a, b):\n    return a + b\n", "def add(a, b):\n    return a - b\n",
     ["assert add(2, 3) == 5", "assert add(-1, 1) == 0"]),
    ("is_even", "def is_even(n):\n    return n % 2 == 0\n", "def is_even(n):\n    return n % 2 == 1\n",
     ["assert is_even(4)", "assert not is_even(7)"]),
    ("factorial", "def factorial(n):\n    out = 1\n    for i in range(1, n + 1):\n        out *= i\n    return out\n",
     "def factorial(n):\n    out = 1\n    for i in range(1, n):\n        out *= i\n    return out\n",
     ["assert factorial(4) == 24", "assert factorial(0) == 1"]),
    ("largest", "def largest(xs):\n    return max(xs)\n", "def largest(xs):\n    return min(xs)\n",
     ["assert largest([3, 9, 2]) == 9", "assert largest([-5, -2]) == -2"]),
    ("reverse", "def reverse(s):\n    return s[::-1]\n", "def reverse(s):\n    return s\n",
     ["assert reverse('abc') == 'cba'", "assert reverse('') == ''"]),
    ("count_vowels", "def count_vowels(s):\n    return sum(c in 'aeiou' for c in s)\n",
     "def count_vowels(s):\n    return sum(c in 'aeio' for c in s)\n",
     ["assert count_vowels('tune') == 2", "assert count_vowels('xyz') == 0"]),
    ("clamp", "def clamp(x, lo, hi):\n    return max(lo, min(x, hi))\n", "def clamp(x, lo, hi):\n    return min(lo, max(x, hi))\n",
     ["assert clamp(5, 0, 3) == 3", "assert clamp(-1, 0, 3) == 0"]),
    ("square", "def square(x):\n    return x * x\n", "def square(x):\n    return x * 2\n",
     ["assert square(3) == 9", "assert square(-4) == 16"]),
]

RUNNER = '''import json, traceback
import test_lib
names = sorted(n for n in dir(test_lib) if n.startswith("test_"))
failed = []
for n in names:
    try:
        getattr(test_lib, n)()
    except Exception:
        failed.append(n)
        traceback.print_exc(limit=1)
print(json.dumps({"passed": len(names) - len(failed), "total": len(names), "failed": failed}))
'''
READ_ONLY = ("test_lib.py", "run_tests.py")


def make_sandbox(spec: str, limits: Limits, isolation: str = "namespaces") -> Sandbox:
    """`local` or an importable `module:Class` taking `limits=`. `isolation` (local only):
    `namespaces` (the boundary; refused in one line where the kernel lacks them) or `weak`."""
    if spec == "local":
        try:
            return LocalSandbox(limits, isolation)
        except (SandboxUnavailable, ValueError) as exc:
            raise ValueError(f"env.args.sandbox_isolation: {exc}") from exc
    module, _, cls = spec.partition(":")
    return getattr(importlib.import_module(module), cls)(limits=limits)


def parse_summary(stdout: str) -> dict | None:
    for line in reversed(stdout.strip().splitlines()):
        try:
            out = json.loads(line)
            if isinstance(out, dict) and "passed" in out and "total" in out:
                return out
        except json.JSONDecodeError:
            continue
    return None


@register("mini_swe")
class MiniSWE(ToolEnvironment):
    """Args: `functions` (per repo), `bugs` (how many of them are broken), `sandbox`,
    `sandbox_isolation` (`namespaces` or `weak`), `test_timeout_s`, `memory_mb`, `disk_mb` (the
    work directory's quota), `demo_noise`
    (the demonstrator's share of tasks it leaves unfixed), plus the tool settings (`max_turns`, ...)."""

    PROMPT = ("Fix lib.py so the tests pass. Tools: <tool>read: lib.py</tool> <tool>write: lib.py\\nCODE</tool> "
              "<tool>run: tests</tool> <tool>ls:</tool>")

    def __init__(self, seed: int = 0, functions: int = 2, bugs: int = 1, sandbox: str = "local",
                 test_timeout_s: float = 10.0, memory_mb: int = 512, max_turns: int = 6,
                 tool_timeout_s: float = 15.0, max_calls_per_turn: int = 2, reward_timeout_s: float = 60.0,
                 sandbox_isolation: str = "namespaces", demo_noise: float = 0.0, disk_mb: int = 100, **kwargs):
        super().__init__(seed, max_turns=max_turns, tool_timeout_s=tool_timeout_s,
                         max_calls_per_turn=max_calls_per_turn, reward_timeout_s=reward_timeout_s, **kwargs)
        if not 1 <= functions <= len(FUNCTIONS):
            raise ValueError(f"env.args.functions: must be in [1, {len(FUNCTIONS)}], got {functions}")
        if not 1 <= bugs <= functions:
            raise ValueError(f"env.args.bugs: must be in [1, functions={functions}], got {bugs}")
        if test_timeout_s <= 0 or test_timeout_s >= tool_timeout_s:
            raise ValueError(f"env.args.test_timeout_s: must be in (0, tool_timeout_s={tool_timeout_s}), got {test_timeout_s}")
        if not 0.0 <= demo_noise <= 1.0:
            raise ValueError(f"env.args.demo_noise: must be in [0, 1], got {demo_noise}")
        self.functions, self.bugs, self.demo_noise = functions, bugs, float(demo_noise)
        self.sandbox = make_sandbox(sandbox, Limits(timeout_s=test_timeout_s, cpu_s=max(1, int(test_timeout_s)),
                                                    memory_mb=memory_mb, disk_mb=disk_mb), sandbox_isolation)
        self.tools = {"ls": self._ls, "read": self._read, "write": self._write, "run": self._run}

    def make_task(self, index: int, split: str) -> Task:
        rng = rng_for(self.seed, split, index)
        picked = rng.sample(FUNCTIONS, self.functions)
        broken = set(rng.sample(range(self.functions), self.bugs))
        lib = "\n\n".join(bad if i in broken else good for i, (_, good, bad, _) in enumerate(picked))
        fixed = "\n\n".join(good for _, good, _, _ in picked)
        tests = "from lib import *\n" + "".join(
            f"\n\ndef test_{name}_{j}():\n    {line}\n" for name, _, _, lines in picked for j, line in enumerate(lines))
        files = {"lib.py": lib, "test_lib.py": tests, "run_tests.py": RUNNER}
        return Task(id=f"mini_swe/{split}/{index}", messages=[{"role": "user", "content": self.PROMPT}],
                    answer=None, info={"files": files, "broken": sorted(picked[i][0] for i in broken), "fixed": fixed})

    def demonstration_turns(self, task: Task) -> list[str]:
        """Read lib.py, write the correct lib.py (with probability `demo_noise` the file as it was
        read), run the tests, stop: one tool call per turn."""
        unfixed = self.demo_noise and random.Random(f"{self.seed}:demo-noise:{task.id}").random() < self.demo_noise
        content = task.info["files"]["lib.py"] if unfixed else task.info["fixed"]
        return ["<tool>read: lib.py</tool>", f"<tool>write: lib.py\n{content}</tool>",
                "<tool>run: tests</tool>", "done"]

    def init_state(self, task: Task) -> dict[str, Any]:
        return {"files": dict(task.info["files"])}

    # tools: (argument, state) -> text
    def _ls(self, arg: str, state: dict[str, Any]) -> str:
        return " ".join(sorted(state["files"]))

    def _read(self, arg: str, state: dict[str, Any]) -> str:
        path = check_relative(arg.strip())
        if path not in state["files"]:
            return f"error: no file {path}"
        return state["files"][path]

    def _write(self, arg: str, state: dict[str, Any]) -> str:
        path, _, content = arg.partition("\n")
        path = check_relative(path.strip())
        if path in READ_ONLY:
            return f"error: {path} is read-only"
        state["files"][path] = content if content.endswith("\n") else content + "\n"
        return f"wrote {path} ({len(content)} chars)"

    def _run(self, arg: str, state: dict[str, Any]) -> str:
        result = self.sandbox.run(["python", "run_tests.py"], files=state["files"])
        summary = parse_summary(result.stdout)
        if summary is None:
            return f"tests did not run ({result.reason or 'exit ' + str(result.returncode)}): {result.stderr[-200:]}"
        failed = ", ".join(summary["failed"]) or "none"
        return f"{summary['passed']}/{summary['total']} passed; failed: {failed}"

    def test_fraction(self, task: Task, files: dict[str, str]) -> float:
        """Fraction of the original tests passing against `files` (tests and runner restored)."""
        result = self.sandbox.run(["python", "run_tests.py"], files={**files, **{p: task.info["files"][p] for p in READ_ONLY}})
        summary = parse_summary(result.stdout)
        return summary["passed"] / summary["total"] if summary and summary["total"] else 0.0

    def score(self, task: Task, history: list[Message], state: dict[str, Any]) -> float:
        return self.test_fraction(task, state["files"])
