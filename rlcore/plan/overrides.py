"""Checks around Hydra's composition (:func:`rlcore.plan.compose.compose`), each raising ConfigError:
the recipe named, every key the command line sets (and the config group options it picks), Hydra's and OmegaConf's own errors (one
line naming the key), the composed config's keys (a recipe's or YAML file's misspelt ones),
and engine options typed for an engine the run does not use.

Parsing the command line stays in :mod:`rlcore.run`; what is wrong with it is decided here.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from omegaconf import DictConfig

from rlcore.config.errors import ConfigError, raise_problems
from rlcore.config.schema import RunConfig
from rlcore.engine.registry import inert_options
from rlcore.plan.keys import group_option_problem, multirun_hint, unknown_key, unknown_keys


def one_line(exc: BaseException) -> str:
    """Hydra and OmegaConf errors span several lines (key, value, type); keep the first two
    meaningful ones on one line."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    cause = exc.__cause__ or exc.__context__
    if cause is not None and str(cause).strip():
        lines += [ln.strip() for ln in str(cause).splitlines()[:1] if ln.strip()]
    keep = [ln for ln in lines if not ln.startswith(("object_type", "Set the environment variable"))]
    return " | ".join(keep[:3]) or type(exc).__name__


def override_key(override: str) -> str:
    """The dotted key an override sets (`+a.b=1` -> `a.b`)."""
    return override.lstrip("~+").partition("=")[0]


def check_recipe(name: str, known: list[str]) -> None:
    """`recipe=NAME` names one of the recipes `known`."""
    if name not in known:
        raise ConfigError("recipe", f"unknown recipe {name!r}; choose one of {known}")


def check_override_keys(overrides: list[str], conf_dir: Path) -> None:
    """Every key the overrides set is declared by the schema (with or without `+`), and every
    config group option they pick (`env=NAME`) is a file of `conf_dir`."""
    for o in overrides:
        key = override_key(o)
        if key != "recipe":
            raise_problems([p] if (p := group_option_problem(o, conf_dir)) else [])
        if key != "recipe" and not key.startswith("hydra.") and "@" not in key:
            why = unknown_key(key)
            if why:
                raise ConfigError(key, why)


def _key_from(exc: BaseException) -> str | None:
    cause = exc.__cause__ or exc.__context__
    return getattr(cause, "full_key", None) if cause else None


@contextmanager
def composition_errors() -> Iterator[None]:
    """Inside, any exception (Hydra and OmegaConf raise many types; all mean "bad config") is
    reported as ConfigError under the key it names, a misspelt key with its nearest valid one."""
    try:
        yield
    except Exception as exc:
        key = getattr(exc, "full_key", None) or _key_from(exc)
        why = unknown_key(key) if key else None  # a YAML file's misspelt key: name the nearest one
        raise ConfigError(key or "config", why or multirun_hint(one_line(exc))) from None


def check_composed_keys(node: DictConfig) -> None:
    """The composed config declares no key the schema lacks (a recipe's or a YAML file's own)."""
    raise_problems(unknown_keys(node))


def _typed(key: str, overrides: list[str]) -> bool:
    """Whether an override sets `key`, a key below it or a section above it."""
    return any(k == key or key.startswith(k + ".") or k.startswith(key + ".") for k in map(override_key, overrides))


def check_typed_options(cfg: RunConfig, overrides: list[str]) -> None:
    """No option of an engine the run does not use is set on this command line (a mistake;
    the same option from a YAML file is only warned about: `rlcore.run.warn_inert`)."""
    raise_problems([(k, f"{m}: drop it or select that engine") for k, m in inert_options(cfg) if _typed(k, overrides)])
