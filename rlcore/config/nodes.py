"""The schema and a config as OmegaConf nodes: the node Hydra composes against, the composed
node as a :class:`RunConfig` and back (config.yaml, `--cfg job`, loggers, checkpoints), plug-in
engines' sections (:mod:`rlcore.config.plugins`) included each way."""

from __future__ import annotations

import functools
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from rlcore.config.plugins import plugin_sections, set_plugin_sections
from rlcore.config.schema import RunConfig

ENGINE_GROUPS = ("rollout", "teacher")
"""Sections that hold one section per engine (`rollout.vllm`, `teacher.hf`, ...)."""


def schema_node() -> DictConfig:
    """The schema as the node Hydra composes against: :class:`RunConfig`, plus each plug-in
    engine's section under `rollout` and `teacher`, typed by its options dataclass."""
    node = OmegaConf.structured(RunConfig)
    _add_plugin_nodes(node, {name: OmegaConf.structured(options) for name, options in plugin_sections().items()})
    return node


def read_only_schema_node() -> DictConfig:
    """:func:`schema_node`, read-only, built once per set of plug-in sections: the node the key
    checks of every composition read (~30 ms to build; it was built once per override)."""
    return _read_only_schema(tuple(plugin_sections().items()))


@functools.lru_cache(maxsize=8)
def _read_only_schema(sections: tuple[tuple[str, type], ...]) -> DictConfig:
    node = schema_node()  # plugin_sections() is `sections` now: the cache key
    OmegaConf.set_readonly(node, True)
    return node


def _add_plugin_nodes(node: DictConfig, sections: dict[str, Any], groups=ENGINE_GROUPS) -> None:
    for group in groups:
        with open_dict(node[group]):
            for name, section in sections.items():
                node[group][name] = section


def to_run_config(node: DictConfig) -> RunConfig:
    """A composed node as a :class:`RunConfig`, plug-in sections included (set on its `rollout`
    and `teacher` instances, as their options dataclasses)."""
    obj: RunConfig = OmegaConf.to_object(node)
    for group in ENGINE_GROUPS:
        set_plugin_sections(
            getattr(obj, group),
            {name: OmegaConf.to_object(node[group][name]) for name in plugin_sections() if name in node[group]},
        )
    return obj


def to_node(cfg: RunConfig) -> DictConfig:
    """`cfg` as an OmegaConf node, plug-in sections included (config.yaml, `--cfg job`)."""
    node = OmegaConf.structured(cfg)
    for group in ENGINE_GROUPS:
        _add_plugin_nodes(
            node,
            {name: OmegaConf.structured(getattr(getattr(cfg, group), name)) for name in plugin_sections()},
            groups=(group,),
        )
    return node


def config_dict(cfg: RunConfig) -> dict[str, Any]:
    """The resolved config as plain containers (for config.yaml, checkpoints and loggers)."""
    return OmegaConf.to_container(to_node(cfg), resolve=True)
