"""A key walked from the schema to the code that reads it: `python -m rlcore.plan.walk KEY...`.

Every read of a config value goes through its section object (`cfg.rollout.x`, `r.x` after
`r = cfg.rollout`, a parameter typed `RolloutConfig`, `self.pd` set from one, `getattr(section,
"x")`). This module
parses the sources of `rlcore/` and `actors/` (the schema itself aside) and, for a dotted key,
lists the functions where its section object is read for it: where the key acts.
`tests/test_key_walk.py` bounds those places for the keys that once meant different numbers in
different places (`rollout.max_requests_per_actor`, `algo.max_off_policy_steps`).

What it does not follow: a value handed on as a plain number (`GenerationSlots(engine, n)`)
is read where the section is read, which is the point; a section passed through a name the
function does not type or assign from a section (`x.slots` of an unknown `x`) is not a read.
"""

from __future__ import annotations

import ast
import dataclasses
import sys
import typing
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from rlcore.config import RunConfig

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("rlcore", "actors")
SKIP = ("rlcore/config/", "rlcore/plan/reference.py", "rlcore/plan/walk.py")
"""The schema (it declares keys, it reads none) and the modules that walk it."""
RUN_NAMES = {"cfg", "config", "run_cfg"}
"""Names a whole run config goes by (`cfg`, `self.cfg`)."""


@dataclass(frozen=True)
class Site:
    """One read of a key: the file, the function (`Class.method`, or `<module>`) and the line."""

    path: str
    function: str
    line: int

    def __str__(self) -> str:
        return f"{self.path}:{self.line} {self.function}"


@cache
def sections() -> dict[str, type]:
    """Every section of the schema by its dotted path ("" is the run; `rollout.sampling`, ...)."""
    out: dict[str, type] = {}

    def walk(cls: type, prefix: str) -> None:
        out[prefix] = cls
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            for candidate in (hints[f.name], *typing.get_args(hints[f.name])):
                if dataclasses.is_dataclass(candidate):
                    walk(candidate, f"{prefix}{f.name}.".lstrip("."))

    walk(RunConfig, "")
    return {k.rstrip("."): v for k, v in out.items()}


@cache
def _paths_of_class() -> dict[str, tuple[str, ...]]:
    """Section class name -> the section paths holding it (a parameter annotated with it)."""
    out: dict[str, list[str]] = {}
    for path, cls in sections().items():
        for klass in cls.__mro__:
            if dataclasses.is_dataclass(klass):
                out.setdefault(klass.__name__, []).append(path)
    return {k: tuple(v) for k, v in out.items()}


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


class _Reads(ast.NodeVisitor):
    """The section reads of one module, per function: (section path, attribute, line)."""

    def __init__(self) -> None:
        self.found: list[tuple[str, str, str, int]] = []  # function, section, attribute, line
        self.scope: list[str] = []
        self.aliases: list[dict[str, tuple[str, ...]]] = [{}]
        self.members: list[dict[str, tuple[str, ...]]] = [{}]  # `self.x = <a section>` in the class

    def resolve(self, node: ast.AST) -> tuple[str, ...]:
        """The section paths `node` may hold (none: not a known section)."""
        if isinstance(node, ast.Name):
            if node.id in self.aliases[-1]:
                return self.aliases[-1][node.id]
            return ("",) if node.id in RUN_NAMES else ()
        if isinstance(node, ast.Attribute):
            if isinstance(node.value, ast.Name) and node.value.id == "self":
                if node.attr in self.members[-1]:
                    return self.members[-1][node.attr]
                if node.attr in RUN_NAMES:
                    return ("",)
            return tuple(_join(p, node.attr) for p in self.resolve(node.value) if _join(p, node.attr) in sections())
        if isinstance(node, ast.IfExp):  # `a if c else b`: either
            return tuple(dict.fromkeys(self.resolve(node.body) + self.resolve(node.orelse)))
        if isinstance(node, ast.Call):
            name = ast.unparse(node.func).split(".")[-1]
            if name in ("replace", "copy", "deepcopy") and node.args:  # a copy of a section is that section
                return self.resolve(node.args[0])
            return _paths_of_class().get(name, ())  # a section class built in code (its defaults)
        return ()

    def _function(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        aliases = dict(self.aliases[-1])
        for arg in [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]:
            annotation = ast.unparse(arg.annotation) if arg.annotation else ""
            held = _paths_of_class().get(annotation.strip("'\"").split(".")[-1].split(" ")[0])
            if held:
                aliases[arg.arg] = held
        self.scope.append(node.name)
        self.aliases.append(aliases)
        self.generic_visit(node)
        self.aliases.pop()
        self.scope.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = _function

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.scope.append(node.name)
        self.members.append({})
        self.generic_visit(node)
        self.members.pop()
        self.scope.pop()

    def visit_Assign(self, node: ast.Assign) -> None:
        self.generic_visit(node)
        for target in node.targets:
            pairs = (
                zip(target.elts, node.value.elts)
                if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple)
                else [(target, node.value)]
            )
            for name, value in pairs:
                if (
                    isinstance(name, ast.Attribute)
                    and isinstance(name.value, ast.Name)
                    and name.value.id == "self"
                    and name.attr not in RUN_NAMES
                ):
                    held = self.resolve(value)
                    if held:
                        self.members[-1][name.attr] = held
                elif isinstance(name, ast.Name):
                    held = self.resolve(value)
                    if held:
                        self.aliases[-1][name.id] = held
                    else:
                        self.aliases[-1].pop(name.id, None)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        for path in self.resolve(node.value):
            self.found.append((".".join(self.scope) or "<module>", path, node.attr, node.lineno))
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        # getattr(section, "name"[, default])
        if (
            isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
        ):
            for path in self.resolve(node.args[0]):
                self.found.append((".".join(self.scope) or "<module>", path, node.args[1].value, node.lineno))
        self.generic_visit(node)


def module_reads(source: str, path: str) -> dict[str, list[Site]]:
    """The keys read in one module's `source` (named `path` in its sites), each with its sites."""
    visitor = _Reads()
    visitor.visit(ast.parse(source, path))
    reads: dict[str, list[Site]] = {}
    for function, section, attr, line in visitor.found:
        reads.setdefault(_join(section, attr), []).append(Site(path, function, line))
    return reads


@cache
def _all_reads() -> dict[str, tuple[Site, ...]]:
    reads: dict[str, list[Site]] = {}
    for top in SOURCES:
        for file in sorted((ROOT / top).rglob("*.py")):
            rel = file.relative_to(ROOT).as_posix()
            if not rel.startswith(SKIP):
                for key, sites in module_reads(file.read_text(), rel).items():
                    reads.setdefault(key, []).extend(sites)
    return {k: tuple(v) for k, v in reads.items()}


def read_sites(key: str) -> list[Site]:
    """Where the value key `key` (dotted, as on the command line) is read through its section."""
    return list(_all_reads().get(key, ()))


def main(argv: list[str]) -> int:
    """Print each key's read sites, one a line; exit 1 when a key is read nowhere."""
    missing = 0
    for key in argv:
        sites = read_sites(key)
        print(f"{key}: {len(sites)} read(s)")
        print("".join(f"  {site}\n" for site in sites), end="")
        missing += not sites
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
