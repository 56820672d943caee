"""A checkpoint carries the model config it was saved with (`meta.json` -> `config.model`);
evaluating or resuming it builds that model, not the default one.

`use_checkpoint_model` runs right after composing, before validation and Ray: every `model.*`
field the command line does not set is taken from the checkpoint. A field that defines the
model's tensors (`path`, `gguf_file`, `tokenizer`, `arch`) set on the command line to something
else than the checkpoint's is a real mismatch: one config error, not a size mismatch in an actor.
"""

from __future__ import annotations

import logging

from omegaconf import OmegaConf

from rlcore.storage.checkpoint_dirs import resolve_resume, saved_model_config

log = logging.getLogger("rlcore")

SHAPE_KEYS = ("path", "gguf_file", "tokenizer", "arch")
"""`model.*` fields that decide which tensors (names and shapes) the model has."""
ALL = "*"


def explicit_model_keys(overrides: list[str]) -> set[str]:
    """`model.*` fields the overrides set (`model.arch.hidden_size=..` -> `arch`); `model=NAME`
    (a preset) sets them all (`ALL`)."""
    keys: set[str] = set()
    for o in overrides:
        key = o.lstrip("~+").partition("=")[0]
        if key == "model":
            keys.add(ALL)
        elif key.startswith("model."):
            keys.add(key.split(".")[1])
    return keys


def use_checkpoint_model(cfg, explicit: set[str]) -> list[tuple[str, str]]:
    """Set `cfg.model` from the checkpoint `checkpoint.resume` points at (if any). Returns the
    config problem (key, message) of an explicit shape field that disagrees with it, else []."""
    try:
        path = resolve_resume(cfg)
    except ValueError:
        return []  # a bad resume target is reported by validation
    saved = saved_model_config(path) if path is not None else None
    if not saved:
        return []
    current = OmegaConf.to_container(OmegaConf.structured(cfg.model), resolve=True)
    taken = []
    for key, value in saved.items():
        if key not in current or current[key] == value:
            continue
        if ALL in explicit or key in explicit:
            if key in SHAPE_KEYS:
                return [
                    (
                        f"model.{key}",
                        f"the checkpoint {path} was saved with model.{key}={value!r}, "
                        f"the config sets {current[key]!r}; leave model.{key} unset to use the checkpoint's model",
                    )
                ]
            continue  # e.g. model.dtype: a setting, not the model's shape
        setattr(cfg.model, key, value)
        taken.append(key)
    if taken:
        log.info("model config from checkpoint %s: %s", path, ", ".join(f"model.{k}" for k in taken))
    return []
