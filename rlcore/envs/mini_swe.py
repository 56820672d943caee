"""mini_swe: fix a small Python repository so its tests pass, using file and test tools.

Each task is a generated repo: `lib.py` with a few functions, some carrying a planted bug, and
`test_lib.py` with plain-assert tests (what the policy reads), plus the test runner
(`run_tests.py`, :mod:`rlcore.envs.sealed_runner`). The repo lives in the episode state (a dict of files); tools act on it:

    <tool>ls:</tool>                   list files
    <tool>read: PATH</tool>            a file's content
    <tool>write: PATH
    CONTENT</tool>                     replace a file (test files and the runner are read-only)
    <tool>run: tests</tool>            run the tests in the sandbox; their summary

Code only ever runs in a :class:`rlcore.sandbox.Sandbox` (`sandbox` arg: `local` or
`module:Class` for a cluster's container sandbox). Reward = share of the repo's functions whose
every test passes against the agent's final files: the visible ones (`test_lib.py`'s) and
`HIDDEN_PER_FUNCTION` per function with arguments drawn afresh for each scoring run. The tests
are the environment's (names, arguments, expected values from its reference code); their results
come back through :mod:`rlcore.envs.sealed_tests`, a channel the policy's code can neither write
nor predict: printing a summary, exiting early, editing or deleting tests, patching the runner or
the interpreter scores no more than leaving the bug in.

Demonstrations (supervised warm-up): a scripted agent that reads lib.py, writes it back with
every function in its correct form, runs the tests, and stops ("done", no tool call). Its
episodes are played against this environment, so the test run really happens in the sandbox.
`demo_noise` weakens it: with that probability (fixed per task) it writes lib.py back as it read
it, bug included, and loses; a policy imitating it leaves RL something to learn: make the fix.
`functions` sets the difficulty: the `mini_swe` recipe uses 1 (one short function per repo,
a one-line bug, whole episodes of 430-545 characters), which the tiny CPU policy can learn.
"""

from __future__ import annotations

import copy
import importlib
import random
import secrets
from typing import Any

from rlcore.envs.base import Message, register, rng_for
from rlcore.envs.sealed_tests import RUNNER_FILE, RUNNER_SOURCE, Call, run_sealed
from rlcore.envs.tools import ToolEnvironment
from rlcore.sandbox import Limits, LocalSandbox, Sandbox, check_relative
from rlcore.sandbox.local import SandboxUnavailable
from rlcore.types import Task

# (name, correct source, buggy source, the visible tests' arguments)
FUNCTIONS = [
    ("add", "def add(a, b):\n    return a + b\n", "def add(a, b):\n    return a - b\n", [[2, 3], [-1, 1]]),
    ("is_even", "def is_even(n):\n    return n % 2 == 0\n", "def is_even(n):\n    return n % 2 == 1\n", [[4], [7]]),
    (
        "factorial",
        "def factorial(n):\n    out = 1\n    for i in range(1, n + 1):\n        out *= i\n    return out\n",
        "def factorial(n):\n    out = 1\n    for i in range(1, n):\n        out *= i\n    return out\n",
        [[4], [0]],
    ),
    (
        "largest",
        "def largest(xs):\n    return max(xs)\n",
        "def largest(xs):\n    return min(xs)\n",
        [[[3, 9, 2]], [[-5, -2]]],
    ),
    ("reverse", "def reverse(s):\n    return s[::-1]\n", "def reverse(s):\n    return s\n", [["abc"], [""]]),
    (
        "count_vowels",
        "def count_vowels(s):\n    return sum(c in 'aeiou' for c in s)\n",
        "def count_vowels(s):\n    return sum(c in 'aeio' for c in s)\n",
        [["tune"], ["xyz"]],
    ),
    (
        "clamp",
        "def clamp(x, lo, hi):\n    return max(lo, min(x, hi))\n",
        "def clamp(x, lo, hi):\n    return min(lo, max(x, hi))\n",
        [[5, 0, 3], [-1, 0, 3]],
    ),
    ("square", "def square(x):\n    return x * x\n", "def square(x):\n    return x * 2\n", [[3], [-4]]),
]


def _word(rng: random.Random) -> str:
    return "".join(rng.choice("abcdeiorstuxyz") for _ in range(rng.randint(3, 7))) + "u"


# arguments of each function's hidden tests, drawn afresh for every scoring run (so no lookup
# table of the visible tests' answers passes them); the buggy forms fail every draw
HIDDEN = {
    "add": lambda r: [r.randint(-90, 90), r.choice([-1, 1]) * r.randint(1, 90)],
    "is_even": lambda r: [r.randint(-500, 500)],
    "factorial": lambda r: [r.randint(2, 9)],
    "largest": lambda r: [r.sample(range(-60, 60), r.randint(2, 5))],
    "reverse": lambda r: [_word(r) + "q"],
    "count_vowels": lambda r: [_word(r)],
    "clamp": lambda r: (lambda lo, span: [lo + r.randint(1, span + 9), lo, lo + span])(
        r.randint(-20, 20), r.randint(1, 20)
    ),
    "square": lambda r: [r.choice([-1, 1]) * r.randint(3, 40)],
}
HIDDEN_PER_FUNCTION = 2
READ_ONLY = ("test_lib.py", RUNNER_FILE)


def reference(name: str):
    """The correct form of function `name` (the environment's own code, run here)."""
    source = next(good for n, good, _, _ in FUNCTIONS if n == name)
    scope: dict[str, Any] = {}
    exec(source, scope)  # noqa: S102 (a constant of this module)
    return scope[name]


def visible_calls(names: list[str]) -> list[Call]:
    """The tests `test_lib.py` shows: two per function, expected values from `reference`."""
    cases = {n: args for n, _, _, args in FUNCTIONS}
    return [
        Call(f"test_{n}_{j}", n, args, reference(n)(*copy.deepcopy(args)))
        for n in names
        for j, args in enumerate(cases[n])
    ]


def hidden_calls(names: list[str], rng: random.Random) -> list[Call]:
    """`HIDDEN_PER_FUNCTION` tests per function with fresh arguments from `rng`."""
    out = []
    for n in names:
        for j in range(HIDDEN_PER_FUNCTION):
            args = HIDDEN[n](rng)
            out.append(Call(f"hidden_{n}_{j}", n, args, reference(n)(*copy.deepcopy(args))))
    return out


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


@register("mini_swe")
class MiniSWE(ToolEnvironment):
    """Args: `functions` (per repo), `bugs` (how many of them are broken), `sandbox`,
    `sandbox_isolation` (`namespaces` or `weak`), `test_timeout_s`, `memory_mb`, `disk_mb` (the
    work directory's quota), `demo_noise`
    (the demonstrator's share of tasks it leaves unfixed), plus the tool settings (`max_turns`, ...)."""

    PROMPT = (
        "Fix lib.py so the tests pass. Tools: <tool>read: lib.py</tool> <tool>write: lib.py\\nCODE</tool> "
        "<tool>run: tests</tool> <tool>ls:</tool>"
    )
    default_reward_timeout_s = 60.0  # the final test run of a repo, in a sandbox

    def __init__(
        self,
        seed: int = 0,
        functions: int = 2,
        bugs: int = 1,
        sandbox: str = "local",
        test_timeout_s: float = 10.0,
        memory_mb: int = 512,
        max_turns: int = 6,
        tool_timeout_s: float = 15.0,
        max_calls_per_turn: int = 2,
        sandbox_isolation: str = "namespaces",
        demo_noise: float = 0.0,
        disk_mb: int = 100,
        **kwargs,
    ):
        super().__init__(
            seed,
            max_turns=max_turns,
            tool_timeout_s=tool_timeout_s,
            max_calls_per_turn=max_calls_per_turn,
            **kwargs,
        )
        if not 1 <= functions <= len(FUNCTIONS):
            raise ValueError(f"env.args.functions: must be in [1, {len(FUNCTIONS)}], got {functions}")
        if not 1 <= bugs <= functions:
            raise ValueError(f"env.args.bugs: must be in [1, functions={functions}], got {bugs}")
        if test_timeout_s <= 0 or test_timeout_s >= tool_timeout_s:
            raise ValueError(
                f"env.args.test_timeout_s: must be in (0, tool_timeout_s={tool_timeout_s}), got {test_timeout_s}"
            )
        if not 0.0 <= demo_noise <= 1.0:
            raise ValueError(f"env.args.demo_noise: must be in [0, 1], got {demo_noise}")
        self.functions, self.bugs, self.demo_noise = functions, bugs, float(demo_noise)
        self.sandbox = make_sandbox(
            sandbox,
            Limits(timeout_s=test_timeout_s, cpu_s=max(1, int(test_timeout_s)), memory_mb=memory_mb, disk_mb=disk_mb),
            sandbox_isolation,
        )
        self.budget_s = test_timeout_s * 0.8  # the children's share; the runner starts and reports in the rest
        self.tools = {"ls": self._ls, "read": self._read, "write": self._write, "run": self._run}

    def make_task(self, index: int, split: str) -> Task:
        rng = rng_for(self.seed, split, index)
        picked = rng.sample(FUNCTIONS, self.functions)
        broken = set(rng.sample(range(self.functions), self.bugs))
        lib = "\n\n".join(bad if i in broken else good for i, (_, good, bad, _) in enumerate(picked))
        fixed = "\n\n".join(good for _, good, _, _ in picked)
        names = [name for name, _, _, _ in picked]
        tests = "from lib import *\n" + "".join(
            f"\n\ndef {c.name}():\n    assert {c.fn}({', '.join(map(repr, c.args))}) == {c.expected!r}\n"
            for c in visible_calls(names)
        )
        files = {"lib.py": lib, "test_lib.py": tests, RUNNER_FILE: RUNNER_SOURCE}
        return Task(
            id=f"mini_swe/{split}/{index}",
            messages=[{"role": "user", "content": self.PROMPT}],
            answer=None,
            info={"files": files, "functions": names, "broken": sorted(picked[i][0] for i in broken), "fixed": fixed},
        )

    def demonstration_turns(self, task: Task) -> list[str]:
        """Read lib.py, write the correct lib.py (with probability `demo_noise` the file as it was
        read), run the tests, stop: one tool call per turn."""
        unfixed = self.demo_noise and random.Random(f"{self.seed}:demo-noise:{task.id}").random() < self.demo_noise
        content = task.info["files"]["lib.py"] if unfixed else task.info["fixed"]
        return [
            "<tool>read: lib.py</tool>",
            f"<tool>write: lib.py\n{content}</tool>",
            "<tool>run: tests</tool>",
            "done",
        ]

    def init_state(self, task: Task) -> dict[str, Any]:
        return {"files": dict(task.info["files"]), "functions": list(task.info["functions"])}

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
        verdict = run_sealed(self.sandbox, state["files"], visible_calls(state["functions"]), self.budget_s)
        if verdict.problem:
            r = verdict.result
            return (
                f"tests did not run ({verdict.problem}; {r.reason or 'exit ' + str(r.returncode)}): {r.stderr[-200:]}"
            )
        failed = ", ".join(f"{name} ({why})" for name, why in verdict.failed.items()) or "none"
        return f"{len(verdict.passed)}/{verdict.total} passed; failed: {failed}"

    def test_fraction(self, task: Task, files: dict[str, str]) -> float:
        """Share of the task's functions whose every test passes against `files` (the read-only
        files restored), hidden ones included: answers copied from the visible tests, by code or
        by a forged report, fix nothing."""
        names = task.info["functions"]
        calls = visible_calls(names) + hidden_calls(names, random.Random(secrets.randbits(64)))
        verdict = run_sealed(
            self.sandbox, {**files, **{p: task.info["files"][p] for p in READ_ONLY}}, calls, self.budget_s
        )
        broken = {c.fn for c in calls if c.name in verdict.failed}
        return sum(n not in broken for n in names) / len(names)

    def score(self, task: Task, history: list[Message], state: dict[str, Any]) -> float:
        return self.test_fraction(task, state["files"])
