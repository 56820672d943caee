"""Test results the policy's code cannot write: calls chosen by the environment, run in the
sandbox by :mod:`rlcore.envs.sealed_runner`, judged by the environment.

The environment decides which calls exist (their names, arguments and expected values: the total
is its own), writes a per-run random nonce into the runner's spec file, and runs the runner in
the sandbox. The runner deletes the spec before any of the policy's code runs, runs that code in
child processes that never hold the runner's stdout, and prints one line prefixed with the
nonce: each call's value (or error) as the children reported it. Here that line is read (exactly
one, or the run has no result), and a call passes only when its reported value equals the
expected one. What the policy's code prints, exits with, writes into the work directory or
patches in its own interpreter reaches the verdict only as the values of its own calls.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlcore.envs import sealed_runner
from rlcore.sandbox import Sandbox, SandboxResult

RUNNER_FILE = "run_tests.py"
RUNNER_SOURCE = Path(sealed_runner.__file__).read_text()
SPEC_FILE = sealed_runner.SPEC_FILE


@dataclass
class Call:
    """One test: `fn(*args)` must return `expected` (compared as JSON: type and value)."""

    name: str
    fn: str
    args: list
    expected: Any


@dataclass
class Verdict:
    """What a sealed run established, for the calls the environment chose."""

    total: int
    passed: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    """Test name -> why it failed."""
    problem: str | None = None
    """Why no report was read (then every test failed), else None."""
    result: SandboxResult | None = None

    @property
    def fraction(self) -> float:
        return len(self.passed) / self.total if self.total else 0.0


def _same(value: Any, expected: Any) -> bool:
    return json.dumps(value, sort_keys=True) == json.dumps(expected, sort_keys=True)


def read_report(stdout: str, nonce: str) -> tuple[dict | None, str | None]:
    """The runner's report from `stdout` (the one line prefixed with `nonce`), or why there is none."""
    lines = [line for line in stdout.splitlines() if line.startswith(nonce + " ")]
    if len(lines) != 1:
        return None, "no test report" if not lines else f"{len(lines)} test reports (one is written)"
    try:
        report = json.loads(lines[0][len(nonce) + 1 :])
    except json.JSONDecodeError:
        return None, "an unreadable test report"
    return (report, None) if isinstance(report, dict) else (None, "an unreadable test report")


def run_sealed(sandbox: Sandbox, files: dict[str, str], calls: list[Call], budget_s: float) -> Verdict:
    """Run `calls` against `files` in `sandbox` (the runner and its spec replace any file of
    those names); `budget_s`: the children's time in all (less than the sandbox's timeout)."""
    nonce = secrets.token_hex(16)
    spec = {"nonce": nonce, "budget_s": budget_s, "calls": [[c.name, c.fn, c.args] for c in calls]}
    result = sandbox.run(
        ["python", "-I", RUNNER_FILE], files={**files, RUNNER_FILE: RUNNER_SOURCE, SPEC_FILE: json.dumps(spec)}
    )
    if result.reason == "isolation_failed":  # the sandbox failed, not the policy's code: no verdict to give
        raise RuntimeError(f"the sandbox could not run the tests: {result.stderr.strip()[-300:]}")
    verdict = Verdict(total=len(calls), result=result)
    report, verdict.problem = read_report(result.stdout, nonce)
    for c in calls:
        entry = (report or {}).get(c.name)
        if isinstance(entry, dict) and "value" in entry and _same(entry["value"], c.expected):
            verdict.passed.append(c.name)
        elif isinstance(entry, dict) and "value" in entry:
            verdict.failed[c.name] = f"returned {json.dumps(entry['value'])[:80]}"
        else:
            why = entry.get("error") if isinstance(entry, dict) else None
            verdict.failed[c.name] = str(why or verdict.problem or "not reported")[:200]
    return verdict
