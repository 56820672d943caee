"""Bounds and allowed values written on the schema's fields, and the one check that reads them.

OmegaConf's structured configs refuse `typing.Literal`, so a field says what it accepts in its
`dataclasses.field` metadata: `choice("a", "b", default="a", noun="mode")` (one of these values),
`bounded(1.0, gt=0)` (a number in a range; None passes an Optional field), or
`from_registry("rlcore/algo/registry.py", default="grpo")` (the allowed values are a registry's,
checked there: the field only says where). `field_problems(cfg)` walks every section and returns
one `(dotted key, message)` per value outside its field's metadata; a section with an `enabled`
field is checked only when it is enabled (LoRA, the teacher, prefill/decode disaggregation), an
engine's own section (`metadata={"engine_section": True}`: `rollout.vllm`) only when its group
runs that engine (the others are refused or warned about by name: `rlcore.engine.registry`).
`field_rule` renders a field's metadata for the configuration reference. A leaf: it imports
nothing of rlcore.
"""

from __future__ import annotations

import dataclasses
from typing import Any

Problem = tuple[str, str]


def choice(*values: Any, default: Any, noun: str = "value") -> Any:
    """A field whose value must be one of `values`; the refusal reads
    `unknown NOUN 'x'; choose one of [...]`."""
    return dataclasses.field(default=default, metadata={"choices": tuple(values), "noun": noun})


def bounded(
    default: Any = dataclasses.MISSING,
    *,
    ge: Any = None,
    gt: Any = None,
    le: Any = None,
    lt: Any = None,
    note: str = "",
    default_factory: Any = dataclasses.MISSING,
) -> Any:
    """A number field with inclusive (`ge`, `le`) or exclusive (`gt`, `lt`) bounds; `note` is said
    with the bound (`must be >= 0 (0 = never), got -1`)."""
    meta = {k: v for k, v in (("ge", ge), ("gt", gt), ("le", le), ("lt", lt)) if v is not None}
    if note:
        meta["note"] = note
    return dataclasses.field(default=default, default_factory=default_factory, metadata=meta)


def from_registry(source: str, *, default: Any) -> Any:
    """A field whose allowed values are a registry's (names that can grow at run time, or an
    import path): checked by that registry, named here so a reader knows where to look."""
    return dataclasses.field(default=default, metadata={"choices_from": source})


def choices_of(cls: type, name: str) -> tuple:
    """The allowed values written on field `name` of dataclass `cls`."""
    return next(f.metadata["choices"] for f in dataclasses.fields(cls) if f.name == name)


def _shown(value: Any) -> str:
    return "null" if value is None else str(value)


def _lower(meta: dict) -> tuple[Any, bool] | None:
    if "ge" in meta:
        return meta["ge"], True
    return (meta["gt"], False) if "gt" in meta else None


def _upper(meta: dict) -> tuple[Any, bool] | None:
    if "le" in meta:
        return meta["le"], True
    return (meta["lt"], False) if "lt" in meta else None


def bound_text(meta: dict) -> str:
    """`> 0`, `>= 1`, `in [0, 1)`... of a field's metadata ("" when it has no bound)."""
    low, high = _lower(meta), _upper(meta)
    if low and high:
        return f"in {'[' if low[1] else '('}{low[0]}, {high[0]}{']' if high[1] else ')'}"
    if low:
        return f"{'>=' if low[1] else '>'} {low[0]}"
    if high:
        return f"{'<=' if high[1] else '<'} {high[0]}"
    return ""


def _in_bounds(value: Any, meta: dict) -> bool:
    # written as `not (...)` tests so that nan fails every bound
    low, high = _lower(meta), _upper(meta)
    try:
        if low and not (value >= low[0] if low[1] else value > low[0]):
            return False
        return not (high and not (value <= high[0] if high[1] else value < high[0]))
    except TypeError:  # not a number: OmegaConf refuses it while composing; a hand-built config here
        return False


def value_problem(key: str, value: Any, meta: dict) -> str | None:
    """What is wrong with `value` under a field's metadata `meta`; None when nothing is."""
    if "choices" in meta and value not in meta["choices"]:
        return f"unknown {meta.get('noun', 'value')} {value!r}; choose one of {', '.join(map(_shown, meta['choices']))}"
    if value is not None and bound_text(meta) and not _in_bounds(value, meta):
        note = f" {meta['note']}" if meta.get("note") else ""
        return f"must be {bound_text(meta)}{note}, got {value!r}"
    return None


def field_problems(section: Any, prefix: str = "") -> list[Problem]:
    """`(dotted key, message)` for every value of `section` (a dataclass instance) and its
    sub-sections outside its field's bounds or allowed values, in schema order."""
    if getattr(section, "enabled", True) is False:
        return []
    out: list[Problem] = []
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if dataclasses.is_dataclass(value):
            if not f.metadata.get("engine_section") or getattr(section, "engine", None) == f.name:
                out += field_problems(value, f"{prefix}{f.name}.")
            continue
        message = value_problem(f"{prefix}{f.name}", value, f.metadata)
        if message:
            out.append((f"{prefix}{f.name}", message))
    return out


def field_rule(f: dataclasses.Field) -> str:
    """A field's bound or allowed values as the configuration reference shows them ("" if none)."""
    meta = f.metadata
    if "choices" in meta:
        return "one of " + ", ".join(f"`{_shown(c)}`" for c in meta["choices"])
    if "choices_from" in meta:
        return f"a name registered in `{meta['choices_from']}`"
    rule = bound_text(meta)
    return f"{rule}{' ' + meta['note'] if meta.get('note') else ''}" if rule else ""
