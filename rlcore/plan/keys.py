"""Keys against the schema: every key a user writes (command line, recipe, YAML) must exist in
:class:`rlcore.config.RunConfig`, and every `env.args` key must be an argument of the chosen
environment's constructor. A misspelt key is reported with the nearest valid one (difflib), or with the key of the same
name in another section (`rollout.batch_groups` -> `algo.batch_groups`); a config group's unknown
option (`env=revers_text`) with the nearest option and all of them.

Free-form mappings (`model.arch`, `model.processor`, `rollout.vllm.engine_kwargs`, `env.args.env_kwargs`)
are passed through to transformers / vLLM / the user's code and are not checked here. An engine's
option written at the top of `rollout` / `teacher` (the old flat `rollout.sleep_level`) is refused
with the key it moved to (`rollout.vllm.sleep_level`), and so is a loss's option at its old flat
key (`algo.dapo_clip_eps_high` -> `algo.dapo.clip_eps_high`), and a reward runtime's key at its
old place in `env.args` (`env.args.reward_timeout_s` -> `env.reward.timeout_s`).
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import re
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from rlcore.config.losses import moved_loss_key
from rlcore.config.nodes import ENGINE_GROUPS, read_only_schema_node
from rlcore.config.reward import moved_env_arg
from rlcore.engine.registry import sections

ENV_ARGS = "env.args"


def _section_options() -> list[str]:
    """`vllm.sleep_level`, ...: every engine's options, as keys below `rollout` / `teacher`."""
    return [f"{section}.{f.name}" for section, options in sections().values() for f in dataclasses.fields(options)]


def moved_key(dotted: str, schema: DictConfig) -> str | None:
    """`rollout.X[.rest]` where X is not a key of `rollout` but an option of an engine's section:
    "moved to rollout.<section>.X[.rest]" (each engine that has X named); None otherwise."""
    group, _, rest = dotted.partition(".")
    name = rest.partition(".")[0]
    if group not in ENGINE_GROUPS or not name or name in schema[group]:
        return None
    homes = [
        f"{group}.{section}.{rest}"
        for section, options in sections().values()
        if name in {f.name for f in dataclasses.fields(options)}
    ]
    return f"moved to {' or '.join(homes)} (an engine's own section)" if homes else None


def _nearest(word: str, choices, prefix: str = "") -> str:
    match = difflib.get_close_matches(word, [str(c) for c in choices], n=1, cutoff=0.5)
    return f"; did you mean {prefix + match[0]!r}?" if match else ""


def keys_named(name: str, node: DictConfig, prefix: str = "") -> list[str]:
    """Every dotted key of the schema whose last part is `name` (free-form mappings skipped)."""
    found = []
    for key in node.keys():
        dotted = f"{prefix}{key}"
        if key == name:
            found.append(dotted)
        child = node._get_node(key)
        if isinstance(child, DictConfig) and OmegaConf.get_type(child) is not dict:
            found += keys_named(name, child, dotted + ".")
    return found


def group_option_problem(override: str, conf_dir: Path) -> tuple[str, str] | None:
    """(group, message) when `override` picks a config group's option (`env=NAME`, a file
    `conf_dir/env/NAME.yaml`) that does not exist, naming the nearest option and every one."""
    key, eq, value = override.lstrip("+").partition("=")
    folder = conf_dir / key
    if not eq or "." in key or "/" in key or not folder.is_dir() or not value or "," in value:
        return None
    options = sorted(p.stem for p in folder.glob("*.yaml"))
    if value in options:
        return None
    return key, f"unknown option {value!r}{_nearest(value, options)}; choose one of {options}"


def multirun_hint(message: str) -> str:
    """Hydra's text for `key=a,b` says list or string; a sweep is what was most likely meant."""
    found = re.search(r"Ambiguous value for argument '([^']+)'", message)
    if found:
        return f"{message} | 3. To run one job per value (a sweep), add -m: python -m rlcore.run -m {found[1]}"
    return message


def unknown_key(dotted: str, schema: DictConfig | None = None) -> str | None:
    """Why `dotted` (e.g. `trainer.lr`) is not a key of the schema, or None when it is (keys
    below a free-form mapping, including `env.args`, are accepted here)."""
    root = read_only_schema_node() if schema is None else schema
    node: Any = root
    moved = moved_key(dotted, node) or moved_loss_key(dotted)
    if moved:
        return moved
    done: list[str] = []
    for part in dotted.split("."):
        if isinstance(node, ListConfig) or (isinstance(node, DictConfig) and OmegaConf.get_type(node) is dict):
            return None  # a list index or a free-form mapping: not the schema's business
        if not isinstance(node, DictConfig):
            return f"{'.'.join(done)} is a value, not a section"
        if part not in node:
            prefix = ".".join(done) + "." if done else ""
            choices = list(node.keys()) + (_section_options() if len(done) == 1 and done[0] in ENGINE_GROUPS else [])
            where = f"unknown key{' in ' + '.'.join(done) if done else ''}"
            rest = dotted.split(".")[len(done) + 1 :]  # `part` may head a whole section elsewhere
            elsewhere = [k for k in keys_named(part, root) if unknown_key(".".join([k, *rest]), root) is None]
            if elsewhere:
                return f"{where}; did you mean {' or '.join(repr('.'.join([k, *rest])) for k in elsewhere)}?"
            return f"{where}{_nearest(part, choices, prefix)}"
        done.append(part)
        node = node._get_node(part)
    return None


def unknown_keys(cfg: DictConfig) -> list[tuple[str, str]]:
    """(key, message) for every key of a composed config that the schema does not declare."""
    node_schema = read_only_schema_node()
    out: list[tuple[str, str]] = []

    def walk(node: DictConfig, prefix: str) -> None:
        for key in node.keys():
            dotted = f"{prefix}{key}"
            why = unknown_key(dotted, node_schema)
            if why:
                out.append((dotted, why))
                continue
            child = node._get_node(key)
            if isinstance(child, DictConfig) and not child._is_none() and not child._is_missing():
                walk(child, dotted + ".")

    walk(cfg, "")
    return out


def env_arg_names(cls: type) -> set[str] | None:
    """Keyword arguments an environment class accepts: the parameters of its `__init__`, and,
    where that takes `**kwargs`, those of the next constructor up the MRO (environments forward
    unknown keywords to `super().__init__`). `seed` is `env.seed` and `reward_runtime` is
    `env.reward`, not `env.args` keys.
    None when `**kwargs` reach no declared parameter (then anything is accepted)."""
    names: set[str] = set()
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        if klass is object:
            return None
        params = list(inspect.signature(init).parameters.values())
        names |= {
            p.name
            for p in params[1:]
            if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        }
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
            return names - {"seed", "reward_runtime"}
    return None


def env_arg_problems(env_name: str, cls: type, args: dict[str, Any]) -> list[tuple[str, str]]:
    """(key, message) for each `env.args` key that `cls`'s constructor does not take; a reward
    runtime's key once written here (`env.args.reward_timeout_s`) with the key it moved to."""
    moved = [(f"{ENV_ARGS}.{key}", moved_env_arg(key)) for key in args if moved_env_arg(key)]
    allowed = env_arg_names(cls)
    if moved or allowed is None:
        return moved
    return [
        (
            f"{ENV_ARGS}.{key}",
            f"not an argument of environment {env_name!r}"
            f"{_nearest(key, sorted(allowed), ENV_ARGS + '.') or f'; it takes {sorted(allowed)}'}",
        )
        for key in args
        if key not in allowed
    ]


NODE_LABELS = ("cluster.trainer_node_labels", "cluster.rollout_node_labels")
"""Mappings of Ray node labels: any label key may be set (checked by `rlcore.plan.node_fit`)."""


def typed_env_arg_override(override: str) -> str:
    """`env.args.KEY=V` (and `+env.args.KEY=V`) -> `++env.args.KEY=V`: set or add the key, since
    which keys exist depends on the environment chosen (checked by `env_arg_problems`). The same
    for a node-label mapping, key by key or whole (`cluster.trainer_node_labels={group:trainer}`)."""
    bare = override.lstrip("+")
    key = bare.partition("=")[0]
    addable = key.startswith(ENV_ARGS + ".") or any(key == m or key.startswith(m + ".") for m in NODE_LABELS)
    if addable and "=" in bare and not override.startswith("~"):
        return "++" + bare
    return override
