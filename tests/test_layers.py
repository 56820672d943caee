"""The layer rules of DESIGN.md ("Layers") as import contracts (`[tool.importlinter]` in
pyproject.toml), checked by import-linter's own command on the real packages, and shown to
fail on a violation planted in a copy of them.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")
CONTRACTS = [c["id"] for c in tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]]


def lint(contract: str, root: Path = REPO) -> subprocess.CompletedProcess:
    """`lint-imports` for one contract of `root`'s pyproject.toml, on the packages under `root`."""
    return subprocess.run([str(LINT_IMPORTS), str(root / "pyproject.toml"), "--contract", contract,
                           "--no-cache"], cwd=root, env={"PYTHONPATH": str(root), "PATH": ""},
                          capture_output=True, text=True, timeout=120)


def test_every_contract_is_checked_here():
    assert len(CONTRACTS) == 5


@pytest.mark.parametrize("contract", CONTRACTS)
def test_contract_holds(contract):
    result = lint(contract)
    assert "Contracts: 1 kept, 0 broken." in result.stdout, result.stdout + result.stderr
    assert result.returncode == 0


@pytest.fixture(scope="module")
def copy_of_the_packages(tmp_path_factory) -> Path:
    """rlcore/, actors/ (sources only) and pyproject.toml, copied: a violation is planted in the copy."""
    root = tmp_path_factory.mktemp("layers")
    for package in ("rlcore", "actors"):
        shutil.copytree(REPO / package, root / package, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    shutil.copy(REPO / "pyproject.toml", root)
    return root


PLANTED = {  # id: (contract, {file: text appended, the file created if new}, the import the report names)
    "core-imports-ray": ("core-below-ray", {"rlcore/planted.py": "import ray\n"}, "rlcore.planted -> ray"),
    "config-imports-actors": ("core-below-ray", {"rlcore/config/planted.py": "from actors import remote\n"},
                              "rlcore.config.planted -> actors.remote"),
    "core-imports-actors-indirectly": ("core-below-ray", {"rlcore/planted.py": "from rlcore import packing\n",
                                                          "rlcore/packing.py": "\nfrom actors import remote\n"},
                                       "rlcore.packing -> actors.remote"),
    "actors-import-run": ("nothing-imports-run", {"actors/planted.py": "from rlcore import run\n"},
                          "actors.planted -> rlcore.run"),
    "core-imports-run": ("nothing-imports-run", {"rlcore/planted.py": "import rlcore.run\n"},
                         "rlcore.planted -> rlcore.run"),
    "algo-imports-engine": ("step-and-algo-pure", {"rlcore/algo/planted.py": "from rlcore.engine import registry\n"},
                            "rlcore.algo.planted -> rlcore.engine.registry"),
    "transfer-imports-engine": ("engine-transfer-independent",
                                {"rlcore/transfer/planted.py": "from rlcore.engine import base\n"},
                                "rlcore.transfer.planted -> rlcore.engine.base"),
    "engine-imports-transfer": ("engine-transfer-independent",
                                {"rlcore/engine/planted.py": "from rlcore.transfer import plan\n"},
                                "rlcore.engine.planted -> rlcore.transfer.plan"),
    "step-imports-trainer": ("step-and-algo-pure", {"rlcore/step.py": "\nfrom rlcore.trainer import core\n"},
                             "rlcore.step -> rlcore.trainer.core"),
    "serving-imports-envs": ("serving-without-envs", {"rlcore/serving/planted.py": "import rlcore.envs\n"},
                             "rlcore.serving.planted -> rlcore.envs"),
}


@pytest.mark.parametrize("plant", PLANTED)
def test_a_planted_violation_breaks_the_contract(copy_of_the_packages, plant):
    contract, files, named = PLANTED[plant]
    root = copy_of_the_packages
    before = {path: (root / path).read_text() if (root / path).exists() else None for path in files}
    try:
        for path, text in files.items():
            (root / path).write_text((before[path] or "") + text)
        result = lint(contract, root)
    finally:
        for path, text in before.items():
            if text is None:
                (root / path).unlink()
            else:
                (root / path).write_text(text)
    assert result.returncode == 1 and "BROKEN" in result.stdout, result.stdout + result.stderr
    assert named in result.stdout, result.stdout


def test_the_copy_without_a_plant_keeps_the_contracts_the_real_tree_keeps(copy_of_the_packages):
    for contract in CONTRACTS:
        assert lint(contract, copy_of_the_packages).returncode == 0, contract
