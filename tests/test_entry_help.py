"""Every entry point answers --help (and -h) with its usage on stdout and exit code 0."""

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
ENTRY_POINTS = [
    "rlcore.run",
    "rlcore.mismatch",
    "rlcore.export",
    "rlcore.plot",
    "rlcore.timeline",
    "rlcore.watch",
    "launch.local_cluster",
    "launch.submit",
    "launch.placement_check",
]


@pytest.mark.parametrize("module", ENTRY_POINTS)
@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_entry_point_help(module, flag):
    done = subprocess.run([sys.executable, "-m", module, flag], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (module, done.stdout, done.stderr)
    assert done.stdout.lower().startswith("usage:") and f"python -m {module}" in done.stdout, done.stdout
    assert "error" not in done.stderr.lower(), done.stderr
