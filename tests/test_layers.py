"""The layer rules of README's "Layers" as import contracts (`[tool.importlinter]` in
pyproject.toml), checked by import-linter's own command on the real packages, and shown to
fail on a violation planted in a copy of them.
"""

from __future__ import annotations

import ast
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
    return subprocess.run(
        [str(LINT_IMPORTS), str(root / "pyproject.toml"), "--contract", contract, "--no-cache"],
        cwd=root,
        env={"PYTHONPATH": str(root), "PATH": ""},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_every_contract_is_checked_here():
    assert len(CONTRACTS) == 6


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
    "config-imports-actors": (
        "core-below-ray",
        {"rlcore/config/planted.py": "from actors import remote\n"},
        "rlcore.config.planted -> actors.remote",
    ),
    "core-imports-actors-indirectly": (
        "core-below-ray",
        {
            "rlcore/planted.py": "from rlcore.batch import packing\n",
            "rlcore/batch/packing.py": "\nfrom actors import remote\n",
        },
        "rlcore.batch.packing -> actors.remote",
    ),
    "actors-import-run": (
        "nothing-imports-run",
        {"actors/planted.py": "from rlcore import run\n"},
        "actors.planted -> rlcore.run",
    ),
    "core-imports-run": (
        "nothing-imports-run",
        {"rlcore/planted.py": "import rlcore.run\n"},
        "rlcore.planted -> rlcore.run",
    ),
    "algo-imports-engine": (
        "step-and-algo-pure",
        {"rlcore/algo/planted.py": "from rlcore.engine import registry\n"},
        "rlcore.algo.planted -> rlcore.engine.registry",
    ),
    "transfer-imports-engine": (
        "engine-transfer-independent",
        {"rlcore/transfer/planted.py": "from rlcore.engine import base\n"},
        "rlcore.transfer.planted -> rlcore.engine.base",
    ),
    "engine-imports-transfer": (
        "engine-transfer-independent",
        {"rlcore/engine/planted.py": "from rlcore.transfer import plan\n"},
        "rlcore.engine.planted -> rlcore.transfer.plan",
    ),
    "step-imports-trainer": (
        "step-and-algo-pure",
        {"rlcore/batch/step.py": "\nfrom rlcore.trainer import core\n"},
        "rlcore.batch.step -> rlcore.trainer.core",
    ),
    "serving-imports-envs": (
        "serving-without-envs",
        {"rlcore/serving/planted.py": "import rlcore.envs\n"},
        "rlcore.serving.planted -> rlcore.envs",
    ),
    # the layers contract, one plant per boundary: each layer importing the one above it
    "config-imports-a-core-package": (
        "layers",
        {"rlcore/config/planted.py": "from rlcore.batch import packing\n"},
        "rlcore.config.planted -> rlcore.batch.packing",
    ),
    "core-imports-plan": (
        "layers",
        {"rlcore/envs/planted.py": "from rlcore.plan import validate\n"},
        "rlcore.envs.planted -> rlcore.plan.validate",
    ),
    "plan-imports-actors": (
        "layers",
        {"rlcore/plan/planted.py": "from actors import remote\n"},
        "rlcore.plan.planted -> actors.remote",
    ),
    "actors-import-an-entry-point": (
        "layers",
        {"actors/planted.py": "import rlcore.mismatch\n"},
        "actors.planted -> rlcore.mismatch",
    ),
    "an-entry-point-imports-the-other": (
        "layers",
        {"rlcore/mismatch.py": "\nimport rlcore.run\n"},
        "rlcore.mismatch -> rlcore.run",
    ),
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


def layered_modules() -> set[str]:
    layers = next(
        c
        for c in tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
        if c["id"] == "layers"
    )["layers"]
    return {m.strip() for layer in layers for m in layer.replace("|", ":").split(":")}


def test_every_module_of_rlcore_is_in_a_layer():
    """A new package or top-level module must be placed in the house, or the contract misses it."""
    children = {
        f"rlcore.{p.stem}"
        for p in (REPO / "rlcore").iterdir()
        if (p.suffix == ".py" and p.stem != "__init__") or (p.is_dir() and p.name != "__pycache__")
    }
    assert children - layered_modules() == set()
    assert layered_modules() - children - {"actors"} == set()  # and names nothing that is gone


def package_of(module: str) -> str:
    """The unit of the package graph: actors, a package of rlcore, or a top-level module of rlcore."""
    parts = module.split(".")
    return "actors" if parts[0] == "actors" else ".".join(parts[:2])


def package_graph(root: Path) -> dict[str, set[str]]:
    """Package -> the packages its modules import (any import statement, at any depth, from the AST)."""
    graph: dict[str, set[str]] = {}
    for path in [*(root / "rlcore").rglob("*.py"), *(root / "actors").rglob("*.py")]:
        module = ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
        source = package_of(module)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            else:
                continue
            for name in names:
                if name.split(".")[0] in ("rlcore", "actors") and name != "rlcore":
                    target = package_of(name)
                    exists = (root / (target.replace(".", "/") + ".py")).exists() or (
                        root / target.replace(".", "/")
                    ).is_dir()
                    if target != source and exists:
                        graph.setdefault(source, set()).add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one package (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                component.append(w)
            component.append(v)
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_package_imports_back_into_a_package_that_imports_it():
    graph = package_graph(REPO)
    assert cycles(graph) == []
    assert graph.get("rlcore.config", set()) == set()  # the schema is a leaf


def test_a_planted_package_cycle_is_found(copy_of_the_packages):
    # rlcore.algo imports rlcore.config; a config module that imports algo back closes a cycle
    planted = copy_of_the_packages / "rlcore" / "config" / "planted.py"
    planted.write_text("def late():\n    from rlcore.algo import registry\n")
    try:
        assert ["rlcore.algo", "rlcore.config"] in cycles(package_graph(copy_of_the_packages))
    finally:
        planted.unlink()
