"""ruff's lint ([tool.ruff] in pyproject.toml: pyflakes and pycodestyle's errors) holds on the whole
tree, and a planted undefined name is found."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUFF = Path(sys.executable).with_name("ruff")


def ruff(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([str(RUFF), "check", "--no-cache", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120)


def test_the_tree_is_lint_clean():
    result = ruff()
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_planted_undefined_name_is_found(tmp_path):
    (tmp_path / "planted.py").write_text("def f():\n    return undefined_name\n")
    result = ruff("--config", str(ROOT / "pyproject.toml"), str(tmp_path / "planted.py"), cwd=tmp_path)
    assert result.returncode == 1 and "F821" in result.stdout, result.stdout + result.stderr
