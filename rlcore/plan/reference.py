"""The configuration reference, generated from the schema: every key of `RunConfig` with its type,
default, bound or allowed values (the field's metadata: `rlcore.config.bounds`) and the docstring
written under its field (the schema's one line per field).

``python -m rlcore.plan.reference > docs/configuration.md`` writes the docs site's page;
`tests/test_docs.py` checks that the page is what this module makes of today's schema, so a
key added, removed or re-documented without regenerating it fails the suite."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
import typing
from functools import cache
from typing import Any

from rlcore.config import RunConfig
from rlcore.config.bounds import field_rule

HEADER = """# Configuration reference

Every key of the run's config, generated from the schema (`rlcore/config/`) by
`python -m rlcore.plan.reference`; a test keeps this page equal to that output. Set a key on the
command line (`python -m rlcore.run trainer.lr=1e-5`), in a recipe (`recipes/NAME.yaml`) or in
`conf/`. Keys under a free-form mapping (`env.args`, `model.arch`, `*.engine_kwargs`) are passed
on as they are. The column "allowed" is written on the field itself and checked for every key
(`rlcore/config/bounds.py`; a section with an `enabled` key only when it is enabled); checks that
span several keys (layouts, resources) run in `rlcore/plan/validate.py`. Both run before Ray
starts; a bad key or value exits with code 2 and one line.
"""


@cache
def field_docs(cls: type) -> dict[str, str]:
    """The string literal under each field of dataclass `cls` and of the dataclasses it inherits
    from (attribute docstrings, PEP 257); the class's own win."""
    docs: dict[str, str] = {}
    for klass in reversed([k for k in cls.__mro__ if dataclasses.is_dataclass(k)]):
        body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body
        for stmt, nxt in zip(body, body[1:]):
            if (
                isinstance(stmt, ast.AnnAssign)
                and isinstance(stmt.target, ast.Name)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                docs[stmt.target.id] = " ".join(nxt.value.value.split())
    return docs


def _section_type(hint: Any) -> type | None:
    """The dataclass a field holds (through Optional), or None for a value."""
    for candidate in (hint, *typing.get_args(hint)):
        if dataclasses.is_dataclass(candidate):
            return candidate
    return None


def _type_name(hint: Any) -> str:
    if typing.get_origin(hint) is typing.Literal:
        return " \\| ".join(repr(a) for a in typing.get_args(hint))
    return (getattr(hint, "__name__", None) if typing.get_origin(hint) is None else None) or str(hint).replace(
        "typing.", ""
    )


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "(required)"
    return "null" if value is None else repr(value)


def keys(cls: type = RunConfig, prefix: str = "") -> list[tuple[str, str, str, str, str]]:
    """(dotted key, type, default, allowed, docstring) for every value key below `cls`, in schema order;
    a section (a dataclass field) is walked, not listed."""
    rows = []
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        section = _section_type(hints[f.name])
        if section is not None:
            rows += keys(section, f"{prefix}{f.name}.")
        else:
            rows.append(
                (f"{prefix}{f.name}", _type_name(hints[f.name]), _default(f), field_rule(f), docs.get(f.name, ""))
            )
    return rows


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown() -> str:
    """The reference page: one table per top-level section, in schema order."""
    out = [HEADER]
    by_section: dict[str, list[tuple[str, str, str, str, str]]] = {}
    for row in keys():
        by_section.setdefault(row[0].split(".")[0] if "." in row[0] else "(top level)", []).append(row)
    for section, rows in by_section.items():
        out.append(f"\n## `{section}`\n" if section != "(top level)" else "\n## Top level\n")
        out.append("| key | type | default | allowed | what it does |\n|---|---|---|---|---|")
        out += [f"| `{k}` | {_cell(t)} | `{_cell(d)}` | {_cell(rule)} | {_cell(doc)} |" for k, t, d, rule, doc in rows]
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
