"""The directory side of checkpoints (torch-free): layout names, finding the newest complete
checkpoint, what `checkpoint.resume` points at, and the config a checkpoint was saved with.
The trainer-side save/load of the tensors is in :mod:`rlcore.storage.checkpoint`.

A checkpoint folder is a `pathlib.Path` on a filesystem, or a `upath.UPath` (the same API over
fsspec) in an object store (:func:`rlcore.storage.location.storage_path`): the functions here
use only what both give."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from rlcore.storage.location import storage_path

TRAINER_DIR = "trainer"
TRAINER_EXTRA = "trainer_extra.pt"
HF_DIR = "hf"
DRIVER_STATE = "driver_state.pt"
META = "meta.json"
_STEP_RE = re.compile(r"^step_(\d{8})$")
_TRUE = ("true", "latest", "yes", "1")
_FALSE = ("", "false", "no", "0", "none", "null")


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def checkpoint_root(cfg) -> Path:
    """`checkpoint.dir`, or `{output_dir}/checkpoints` (an object-store run's planner sets `checkpoint.dir`
    under its URL, since its `output_dir` is a local staging folder)."""
    return storage_path(cfg.checkpoint.dir or Path(cfg.output_dir) / "checkpoints")


def fresh(path) -> Any:
    """`path`, with its filesystem's listing cache dropped (an object store's client caches
    listings; other processes, the trainer ranks, write there)."""
    fs = getattr(path, "fs", None)
    if fs is not None:
        fs.invalidate_cache()
    return path


PARTS = "parts"
"""meta.json's list of every file the checkpoint needs, as {relative path: least size in bytes}:
each trainer rank's DCP shards, the DCP metadata, rank 0's files and the driver's state."""


def missing_parts(path: Path, parts: dict[str, int]) -> list[str]:
    """The entries of `parts` that `path` does not hold, as this process sees the storage (a
    file absent, or shorter than listed), each as its relative path."""
    out = []
    for rel, size in sorted(parts.items()):
        try:
            if (path / rel).stat().st_size < int(size):
                out.append(f"{rel} (shorter than {size} bytes)")
        except OSError:
            out.append(rel)
    return out


def incomplete(path: Path) -> str | None:
    """Why `path` is not a complete checkpoint, or None. Complete: meta.json (written last), the
    DCP metadata, and every file meta.json lists on the storage (checkpoints written before the
    list existed have none to check)."""
    fresh(path)
    for need in (META, f"{TRAINER_DIR}/.metadata"):
        if not (path / need).is_file():
            return f"no {need}; an interrupted save is never committed"
    try:
        parts = read_meta(path).get(PARTS) or {}
    except (OSError, ValueError, AttributeError) as exc:
        return f"{META} is unreadable ({exc})"
    if not isinstance(parts, dict):
        return f"{META}'s {PARTS} is not a mapping"
    missing = missing_parts(path, parts)
    if missing:
        return f"{len(missing)} of its parts are missing: {', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}"
    return None


def is_complete(path: Path) -> bool:
    return incomplete(path) is None


def list_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under `root`, oldest first."""
    if not fresh(root).is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _STEP_RE.match(p.name)
        if m and p.is_dir() and is_complete(p):
            found.append((int(m.group(1)), p))
    return sorted(found)


def latest_checkpoint(root: Path) -> Path | None:
    found = list_checkpoints(root)
    return found[-1][1] if found else None


def resume_request(cfg) -> str | None:
    """`checkpoint.resume` normalised: None (fresh start), "latest", or a path string."""
    value = cfg.checkpoint.resume
    if value is None or str(value).strip().lower() in _FALSE:
        return None
    if str(value).strip().lower() in _TRUE:
        return "latest"
    return str(value)


def resolve_resume(cfg) -> Path | None:
    """The checkpoint to resume from, or None for a fresh start. Raises ValueError (message
    starts with the key) for a path that is not a complete checkpoint."""
    req = resume_request(cfg)
    if req is None:
        return None
    if req == "latest":
        return latest_checkpoint(checkpoint_root(cfg))
    path = fresh(storage_path(req))
    if path.is_dir() and not is_complete(path) and latest_checkpoint(path) is not None:
        return latest_checkpoint(path)  # a checkpoint *directory* was given: take its newest
    if not path.exists():
        raise ValueError(f"checkpoint.resume: {req!r} does not exist")
    why = incomplete(path)
    if why:
        raise ValueError(f"checkpoint.resume: {req!r} is not a complete checkpoint ({why})")
    return path


def config_problems(cfg) -> list[tuple[str, str]]:
    """Checks of `checkpoint.*` for `rlcore.plan.validate` (the resume target must exist now)."""
    out = []  # interval, keep_last and timeout_s have their bounds on their fields (rlcore.config.bounds)
    try:
        path = resolve_resume(cfg)
    except ValueError as exc:
        key, _, msg = str(exc).partition(": ")
        out.append((key, msg))
        return out
    if path is not None and cfg.mode == "eval" and plain_load_problem(path):
        out.append(("checkpoint.resume", plain_load_problem(path)))
    return out


def plain_load_problem(path: Path) -> str | None:
    """Why a checkpoint's model entries cannot be loaded into the plain transformers model
    (offline export, evaluation without a trainer), or None."""
    try:
        saved = read_meta(path).get("config") or {}
    except (OSError, ValueError):
        return None
    lora = ((saved.get("trainer") or {}).get("lora") or {}) if isinstance(saved, dict) else {}
    if isinstance(lora, dict) and lora.get("enabled"):
        return (
            f"{path} holds LoRA adapters, not merged weights; export it from a run with "
            "checkpoint.export_final=true (the trainer merges them)"
        )
    return None


# -- atomic directory commits ------------------------------------------------------------------


def read_meta(path: Path) -> dict[str, Any]:
    return json.loads((path / META).read_text())


def saved_model_config(path: Path) -> dict[str, Any] | None:
    """The `model` section of the config a checkpoint was saved with, or None when its meta
    file does not carry one (a checkpoint written by hand)."""
    try:
        saved = read_meta(path).get("config")
    except (OSError, ValueError):
        return None
    model = saved.get("model") if isinstance(saved, dict) else None
    return model if isinstance(model, dict) else None
