"""Where `model.path` comes from, checked before Ray starts (torch-free): a local directory, or a
Hugging Face hub id that is cached, or reachable when online. Also the packages a GGUF file needs.

Offline (`HF_HUB_OFFLINE=1`) a hub id must be in the local cache; online an id that is not cached
is looked up once (a short request), so a typo or an unreachable hub is one line, not a traceback
from every actor after start-up.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from rlcore.models.shipped import is_shipped

HUB_LOOKUP_TIMEOUT_S = 5.0
GGUF_PACKAGES = ("gguf", "accelerate")
"""Packages transformers needs to load and dequantize a GGUF file."""

_TRUE = ("1", "true", "yes", "on")


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE


def _cached(repo_id: str, filename: str) -> bool:
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(repo_id, filename), str)


def _hub_lookup(repo_id: str) -> str | None:
    """None when the hub knows `repo_id`; else why not (not found, or the hub cannot be reached)."""
    from huggingface_hub import HfApi
    from huggingface_hub.utils import GatedRepoError, RepositoryNotFoundError

    try:
        HfApi().model_info(repo_id, timeout=HUB_LOOKUP_TIMEOUT_S)
    except GatedRepoError:
        return None  # it exists; the token decides at load time
    except RepositoryNotFoundError:
        return "not found on the Hugging Face hub"
    except Exception as exc:  # any network failure: connection, DNS, timeout, proxy
        return f"the Hugging Face hub cannot be reached ({type(exc).__name__})"
    return None


def model_path_problems(path: str | None, gguf_file: str | None = None) -> list[tuple[str, str]]:
    """One (key, message) when `path` is neither an existing local directory nor a usable hub id."""
    if not path or is_shipped(path):  # a PyPI-shipped model is checked by shipped_problems
        return []
    local = Path(path).expanduser()
    if local.is_dir():
        if gguf_file and not (local / gguf_file).is_file():
            return [("model.gguf_file", f"no file {gguf_file!r} in {path!r}")]
        return []
    hint = (
        "give a local model directory, or download the model while online (with HF_HUB_OFFLINE "
        "unset) so that it is cached"
    )
    if local.exists():
        return [("model.path", f"{path!r} is a file, not a model directory")]
    if path.startswith((".", "/", "~")):
        return [("model.path", f"directory {path!r} does not exist")]
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(path)
    except HFValidationError:
        return [("model.path", f"{path!r} is neither a local directory nor a Hugging Face hub id (org/name)")]
    if _cached(path, gguf_file or "config.json"):
        return []
    if hub_offline():
        return [
            (
                "model.path",
                f"{path!r} is not a local directory and not in the Hugging Face cache (HF_HUB_OFFLINE=1); {hint}",
            )
        ]
    why = _hub_lookup(path)
    if why:
        return [("model.path", f"{path!r} is not a local directory, not cached, and {why}; {hint}")]
    return []


def gguf_problems(gguf_file: str | None) -> list[tuple[str, str]]:
    """A GGUF checkpoint is dequantized by transformers with `gguf` and `accelerate` installed."""
    if not gguf_file:
        return []
    missing = [p for p in GGUF_PACKAGES if importlib.util.find_spec(p) is None]
    if missing:
        return [
            ("model.gguf_file", f"loading a GGUF file needs the package(s) {missing}: pip install " + " ".join(missing))
        ]
    return []
