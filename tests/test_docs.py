"""What README.md and docs/*.md name exists in the code: every repository path, every Python
module or attribute (`rlcore.x.y`, `actors.x`), and every config key (`trainer.lr`, with or without
a value). A key the docs show being refused as moved must be one the config really reports as
moved. A doc that renames or removes something fails here, not in a reader's hands."""

from __future__ import annotations

import dataclasses
import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from rlcore.config import RunConfig
from rlcore.plan.keys import unknown_key

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TOP = "rlcore|actors|conf|recipes|launch|tests|benchmarks|docs|docker"
PATH = re.compile(rf"`((?:{TOP})/[\w./\-*{{}}<>]*)")
MODULE = re.compile(r"`((?:rlcore|actors|launch)(?:\.\w+)+)")
SECTIONS = "|".join(f.name for f in dataclasses.fields(RunConfig))
KEY = re.compile(rf"`\+?((?:{SECTIONS})\.[A-Za-z_][\w.]*)")
FILE_SUFFIXES = {"py", "sbatch", "sh", "yaml", "yml", "json", "jsonl", "toml", "md", "txt"}  # `rlcore.sbatch`: a file
PLACEHOLDER = re.compile(r"[*{}<>]|NAME|OUT|N\b")


def references(pattern: re.Pattern, doc: Path):
    text = doc.read_text()
    for match in pattern.finditer(text):
        yield match.group(1).rstrip("."), text.count("\n", 0, match.start()) + 1, text


def resolves(dotted: str) -> bool:
    """An importable module, or an attribute path below the longest importable prefix."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        try:
            for name in parts[i:]:
                obj = getattr(obj, name)
        except AttributeError:
            return False
        return True
    return False


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_path_named_exists(doc):
    missing = [
        f"{doc.name}:{line}: {path}"
        for path, line, _ in references(PATH, doc)
        if not PLACEHOLDER.search(path) and not (ROOT / path).exists()
    ]
    assert missing == []


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_module_named_resolves(doc):
    missing = [
        f"{doc.name}:{line}: {name}"
        for name, line, _ in references(MODULE, doc)
        if name.rsplit(".", 1)[1] not in FILE_SUFFIXES and not resolves(name)
    ]
    assert missing == []


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_config_key_named_exists(doc):
    wrong = []
    for key, line, text in references(KEY, doc):
        if key.endswith(".py"):  # a file name such as `teacher.py`, not a key
            continue
        why = unknown_key(key)
        context = text.splitlines()[line - 1]
        if why is None or (why.startswith("moved to") and "moved to" in context):
            continue
        wrong.append(f"{doc.name}:{line}: {key}: {why}")
    assert wrong == []


def test_a_wrong_path_module_and_key_are_found(tmp_path):
    doc = tmp_path / "planted.md"
    doc.write_text("See `rlcore/nowhere.py`, `rlcore.batch.nowhere` and `trainer.no_such_key=3`.\n")
    assert [p for p, _, _ in references(PATH, doc)] == ["rlcore/nowhere.py"]
    assert not (ROOT / "rlcore/nowhere.py").exists()
    assert not resolves("rlcore.batch.nowhere") and resolves("rlcore.batch.staleness.is_stale")
    assert [k for k, _, _ in references(KEY, doc)] == ["trainer.no_such_key"]
    assert unknown_key("trainer.no_such_key") is not None and unknown_key("trainer.lr") is None


def test_the_configuration_reference_is_the_schema_today():
    """docs/configuration.md is what `python -m rlcore.plan.reference` makes of the schema, and it
    names every key (regenerate it with that command after changing the schema)."""
    from rlcore.plan.reference import keys, markdown

    page = (ROOT / "docs" / "configuration.md").read_text()
    assert page == markdown(), "docs/configuration.md is stale: python -m rlcore.plan.reference > docs/configuration.md"
    rows = keys()
    assert len(rows) > 150 and all(f"| `{key}` |" in page for key, *_ in rows)
    assert all(doc for *_, doc in rows), [key for key, *_, doc in rows if not doc]  # one docstring per field


def test_the_docs_site_builds_with_no_warning(tmp_path):
    """mkdocs (material theme) in strict mode: a broken link or a page missing from the nav fails."""
    mkdocs = Path(sys.executable).with_name("mkdocs")
    result = subprocess.run(
        [str(mkdocs), "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "WARNING" not in result.stderr, result.stderr
    assert (tmp_path / "site" / "configuration" / "index.html").exists()
