"""Sections of plug-in engines: `rollout.<section>.*` and `teacher.<section>.*` for an engine
registered at run time (:func:`rlcore.engine.registry.register_engine`).

The schema classes stay as declared (the built-in engines' sections are fields of
`RolloutConfig` / `TeacherConfig`). A plug-in's section lives in the table below; the schema node
Hydra composes against (:func:`rlcore.plan.keys.schema`) adds it, typed by the plug-in's
options dataclass, and a composed config carries it as an attribute of its `rollout` / `teacher`
instance. Unregistering the engine removes it from the table, so later configs lack it.
"""

from __future__ import annotations

from typing import Any

_SECTIONS: dict[str, type] = {}


def plugin_sections() -> dict[str, type]:
    """Section attribute -> options dataclass, for every plug-in engine's section."""
    return dict(_SECTIONS)


def add_plugin_section(name: str, options: type) -> None:
    """Declare section `name` (dataclass `options`) under `rollout` and `teacher`; ValueError
    when a different dataclass already holds that name."""
    if _SECTIONS.setdefault(name, options) is not options:
        raise ValueError(f"section {name!r} is already the options of {_SECTIONS[name].__name__}")


def remove_plugin_section(name: str) -> None:
    """Forget section `name` (a no-op when it is not declared)."""
    _SECTIONS.pop(name, None)


class PluginSections:
    """Base of `RolloutConfig` and `TeacherConfig`: a declared plug-in section that a config
    instance has not set yet (one built in Python rather than composed) reads as its defaults,
    kept on the instance so later changes to it stick."""

    def __getattr__(self, name: str) -> Any:
        # only reached when normal lookup fails, i.e. never for a field or a set section
        options = _SECTIONS.get(name)
        if options is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        value = options()
        object.__setattr__(self, name, value)
        return value


def set_plugin_sections(group: Any, values: dict[str, Any]) -> None:
    """Set each plug-in section of `values` (name -> options instance) on `group`."""
    for name, value in values.items():
        object.__setattr__(group, name, value)
