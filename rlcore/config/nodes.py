"""The schema and a config as OmegaConf nodes: the node Hydra composes against, the composed
node as a :class:`RunConfig` and back (config.yaml, `--cfg job`, loggers, checkpoints), plug-in
engines' sections (:mod:`rlcore.config.plugins`) included each way; and the run folder claimed
for a config (its lock, its config.yaml)."""

from __future__ import annotations

from pathlib import Path
from typing import IO, Any

from omegaconf import DictConfig, OmegaConf, open_dict

from rlcore.config.errors import ConfigError
from rlcore.config.plugins import plugin_sections, set_plugin_sections
from rlcore.config.schema import RunConfig
from rlcore.rundir import FolderInUse, hold_output_dir, restart_series

ENGINE_GROUPS = ("rollout", "teacher")
"""Sections that hold one section per engine (`rollout.vllm`, `teacher.hf`, ...)."""


def schema_node() -> DictConfig:
    """The schema as the node Hydra composes against: :class:`RunConfig`, plus each plug-in
    engine's section under `rollout` and `teacher`, typed by its options dataclass."""
    node = OmegaConf.structured(RunConfig)
    _add_plugin_nodes(node, {name: OmegaConf.structured(options) for name, options in plugin_sections().items()})
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
        set_plugin_sections(getattr(obj, group), {name: OmegaConf.to_object(node[group][name])
                                                  for name in plugin_sections() if name in node[group]})
    return obj


def to_node(cfg: RunConfig) -> DictConfig:
    """`cfg` as an OmegaConf node, plug-in sections included (config.yaml, `--cfg job`)."""
    node = OmegaConf.structured(cfg)
    for group in ENGINE_GROUPS:
        _add_plugin_nodes(node, {name: OmegaConf.structured(getattr(getattr(cfg, group), name))
                                 for name in plugin_sections()}, groups=(group,))
    return node


def config_dict(cfg: RunConfig) -> dict[str, Any]:
    """The resolved config as plain containers (for config.yaml, checkpoints and loggers)."""
    return OmegaConf.to_container(to_node(cfg), resolve=True)


def claim_output_dir(cfg: RunConfig) -> tuple[Path, IO]:
    """Create `output_dir`, take its run lock (`rlcore.rundir.hold_output_dir`: a folder another
    live run holds is refused), cut a resume's series back to step 0 when it has no checkpoint,
    and write the composed config as config.yaml. Returns (folder, the open lock); ConfigError
    naming `output_dir` when the folder is held, or cannot be made or written."""
    out = Path(cfg.output_dir).expanduser()
    try:
        lock = hold_output_dir(out)
    except FolderInUse as exc:
        raise ConfigError("output_dir", str(exc)) from None
    except OSError as exc:
        raise ConfigError("output_dir", f"{cfg.output_dir!r}: {exc.strerror or exc}") from None
    try:
        if cfg.mode == "rl":
            restart_series(cfg)
        OmegaConf.save(to_node(cfg), out / "config.yaml")
    except OSError as exc:
        lock.close()
        raise ConfigError("output_dir", f"{cfg.output_dir!r}: {exc.strerror or exc}") from None
    return out, lock
