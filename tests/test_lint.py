"""ruff's lint ([tool.ruff] in pyproject.toml: pyflakes, pycodestyle's errors, import order) and
its formatter hold on the whole tree, and a planted undefined name, an unsorted import block and an
unformatted line are each found."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUFF = Path(sys.executable).with_name("ruff")


def ruff(*args: str, cwd: Path = ROOT, command: str = "check") -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(RUFF), command, "--no-cache", *args], cwd=cwd, capture_output=True, text=True, timeout=120
    )


def test_the_tree_is_lint_clean():
    result = ruff()
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_planted_undefined_name_is_found(tmp_path):
    (tmp_path / "planted.py").write_text("def f():\n    return undefined_name\n")
    result = ruff("--config", str(ROOT / "pyproject.toml"), str(tmp_path / "planted.py"), cwd=tmp_path)
    assert result.returncode == 1 and "F821" in result.stdout, result.stdout + result.stderr


def test_the_tree_is_formatted():
    result = ruff("--check", command="format")
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_planted_unsorted_import_and_unformatted_line_are_found(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text("import sys\nimport os\n\nx = os.sep  +  sys.platform\n")
    config = ("--config", str(ROOT / "pyproject.toml"))
    lint = ruff(*config, str(planted), cwd=tmp_path)
    assert lint.returncode == 1 and "I001" in lint.stdout, lint.stdout + lint.stderr
    fmt = ruff(*config, "--check", str(planted), cwd=tmp_path, command="format")
    assert fmt.returncode == 1 and "planted.py" in fmt.stdout + fmt.stderr, fmt.stdout + fmt.stderr
