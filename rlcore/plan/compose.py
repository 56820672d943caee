"""Composing a run's config: conf/config.yaml, the recipe (`+recipe=NAME`, recipes/NAME.yaml)
and the command-line overrides, through Hydra's compose API, typed against the schema.

Every entry point that reads a config as a run does (`rlcore.run`, `rlcore.mismatch`,
`launch.placement_check`, the benchmarks) composes here; nothing imports `rlcore.run`.
"""

from __future__ import annotations

import sys
from pathlib import Path

from rlcore.config import RunConfig
from rlcore.config.errors import ConfigError, raise_problems
from rlcore.config.nodes import schema_node, to_run_config
from rlcore.config.plugins import plugin_sections
from rlcore.config.reward import carry_moved
from rlcore.plan.keys import typed_env_arg_override
from rlcore.plan.overrides import (
    check_composed_keys,
    check_override_keys,
    check_recipe,
    check_typed_options,
    composition_errors,
)
from rlcore.plan.resume_model import explicit_model_keys, use_checkpoint_model

REPO = Path(__file__).resolve().parents[2]
CONF_DIR = REPO / "conf"
RECIPES_DIR = REPO / "recipes"


def recipes() -> list[str]:
    return sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))


def compose(overrides: list[str]) -> RunConfig:
    """Hydra composition of conf/config.yaml, the recipe, and the command-line overrides,
    typed against the RunConfig schema. A key the schema does not declare is refused, with or
    without `+`; a reward runtime's key at its old place (`env.args.reward_timeout_s`) is carried
    to `env.reward` with a warning. Raises ConfigError."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.config_store import ConfigStore
    from hydra.core.global_hydra import GlobalHydra

    recipe = None
    for o in overrides:
        key, _, value = o.lstrip("+").partition("=")
        if key == "recipe":
            recipe = value
            check_recipe(value, recipes())
    overrides = ["+recipe=" + recipe if o.lstrip("+").startswith("recipe=") else o for o in overrides]
    # `resume=true|PATH` is the documented spelling of `checkpoint.resume=...`
    overrides = ["checkpoint." + o.lstrip("+") if o.lstrip("+").startswith("resume=") else o for o in overrides]
    check_override_keys(overrides, CONF_DIR)
    overrides = [typed_env_arg_override(o) for o in overrides]

    store_schema(ConfigStore.instance())
    GlobalHydra.instance().clear()
    with composition_errors(), initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = hydra_compose(config_name="config", overrides=overrides)
    check_composed_keys(cfg)
    obj = to_run_config(cfg)
    obj.recipe = recipe
    carry_reward_keys(obj)
    check_typed_options(obj, overrides)  # set on this command line for an engine the run does not use
    raise_problems(use_checkpoint_model(obj, explicit_model_keys(overrides)))
    return obj


_stored: list = []
"""[(plug-in sections, the ConfigNode stored for them)]: the schema Hydra composes against."""


def store_schema(store) -> None:
    """The schema in Hydra's ConfigStore as `rlcore_schema`, stored again only when the plug-in
    sections changed (or someone replaced it): Hydra deep-copies a stored node on every load, so
    one stored node serves every composition (building it costs ~30 ms, paid per compose before)."""
    sections = tuple(plugin_sections().items())
    if _stored and _stored[0][0] == sections and store.repo.get("rlcore_schema.yaml") is _stored[0][1]:
        return
    store.store(name="rlcore_schema", node=schema_node())
    _stored[:] = [(sections, store.repo["rlcore_schema.yaml"])]


def carry_reward_keys(cfg: RunConfig) -> None:
    """`env.args.reward_timeout_s` and the other reward runtime keys that moved to `env.reward`:
    carried there, one warning line each on stderr, so recipes and command lines written before
    the move keep their meaning (`rlcore.config.reward.carry_moved`)."""
    try:
        lines = carry_moved(cfg.env.args, cfg.env.reward)
    except ValueError as exc:
        raise ConfigError(*str(exc).split(": ", 1)) from None
    for line in lines:
        print(f"rlcore: warning: {line}", file=sys.stderr)
