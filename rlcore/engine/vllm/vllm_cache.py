"""Per-user caches that let a second start of the same vLLM engine skip its compilation.

vLLM (with torch >= 2.10) keeps the graphs torch.compile built under
``$VLLM_CACHE_ROOT/torch_compile_cache/`` (``<hash>/rank_<i>_<j>/<prefix>/``, and its AOT
artifacts under ``torch_aot_compile/<hash>/``), where the hash covers the engine config, the
model's path among it, the traced source files and the compiler. Two things keep a run from
finding the last run's graphs, and this module fixes both:

- the random-weight model's directory (``config.json``, plus tokenizer and image processor for a
  vision-language model) was a fresh temporary directory each run, so the path, and with it the
  hash, never repeated: `model_dir` writes it under ``<cache>/vllm-models/<content hash>``, the same
  path for the same content;
- the cache root: `compile_cache` points ``VLLM_CACHE_ROOT`` (unless the user set it) to
  ``<cache>/vllm/vllm-<version>-torch-<version>``, one per version pair, so an upgrade starts a
  clean cache instead of filling an old one.

``<cache>`` is rlcore's per-user cache (`rlcore.models.shipped.cache_root`: ``$RLCORE_CACHE_DIR``,
else ``$XDG_CACHE_HOME/rlcore``, else ``~/.cache/rlcore``).

Whether the compile cache will be hit is known only to vLLM once it hashed its config, after
start-up began; `CompileCache` answers before it: an engine with the same arguments (the seed
aside, which vLLM leaves out of its hash too) on the same GPU kind and versions has started from
this root before (a marker per key, written after a start that finished).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Any, Callable

from rlcore.models.shipped import cache_root

NOT_IN_KEY = ("seed", "profiler_config")
"""Engine arguments that do not change the compiled graphs (vLLM's hash leaves them out)."""


def content_hash(path: str | Path) -> str:
    """sha256 over a directory's files: each relative name (sorted) and its bytes."""
    root = Path(path)
    h = hashlib.sha256()
    for f in sorted(p for p in root.rglob("*") if p.is_file()):
        h.update(str(f.relative_to(root)).encode() + b"\0")
        h.update(f.read_bytes())
        h.update(b"\0")
    return h.hexdigest()


def model_dir(write: Callable[[str], None], home: Path | None = None) -> str:
    """The directory `write(path)` fills, at a path named by its content: written into a scratch
    directory, hashed, then renamed to ``<home>/vllm-models/<hash>``; if that exists already (the same
    model as an earlier run, or an engine of this run that got there first) the copy is dropped
    and the existing one returned. Concurrent writers of the same content are safe: the rename
    is atomic and the loser discards its copy."""
    models = (home or cache_root()) / "vllm-models"
    models.mkdir(parents=True, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix=".writing-", dir=models)
    try:
        write(scratch)
        final = models / content_hash(scratch)[:20]
        if not final.exists():
            try:
                os.rename(scratch, final)
                return str(final)
            except OSError:  # another process renamed the same content there first
                if not final.exists():
                    raise
        return str(final)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def versions() -> str:
    """`vllm-<version>-torch-<version>` of the installed packages ("none" for a missing one)."""

    def version(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "none"

    return f"vllm-{version('vllm')}-torch-{version('torch')}"


def gpu_kinds() -> str:
    """The models of this host's NVIDIA GPUs, from the driver's /proc files (no CUDA context is
    created: the engine's own process must be the first to touch the GPU); "" where none."""
    kinds = set()
    for info in Path("/proc/driver/nvidia/gpus").glob("*/information"):
        try:
            for line in info.read_text().splitlines():
                if line.startswith("Model:"):
                    kinds.add(line.split(":", 1)[1].strip())
        except OSError:
            continue
    return ", ".join(sorted(kinds))


def compile_key(engine_args: dict[str, Any], device: str = "") -> str:
    """The key of an engine's compiled graphs: its arguments but `NOT_IN_KEY`, and the GPU kind
    `device` (a graph compiled for one GPU is not another's)."""
    kept = {k: v for k, v in engine_args.items() if k not in NOT_IN_KEY}
    text = json.dumps({"args": kept, "device": device}, sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class CompileCache:
    """The compile cache of one engine start (module docstring). `root`: vLLM's cache root
    (``VLLM_CACHE_ROOT``); `hit`: an engine with this key finished starting from it before."""

    def __init__(self, root: str | Path, key: str, compiles: bool = True):
        self.root, self.key, self.compiles = Path(root), key, compiles
        self.marker = self.root / "rlcore_started" / key
        self.hit = compiles and self.marker.exists()

    def note(self) -> str:
        """The one line a run prints about it."""
        if not self.compiles:
            return "vLLM compile cache: not used (enforce_eager: the engine compiles nothing)"
        if self.hit:
            return f"vLLM compile cache: hit (key {self.key} under {self.root}): compiled graphs reused"
        return (
            f"vLLM compile cache: miss (key {self.key} under {self.root}): this start compiles, "
            "the next one with the same model and engine settings reuses it"
        )

    def started(self) -> None:
        """The engine finished starting: its graphs are in the cache now."""
        if self.compiles:
            self.marker.parent.mkdir(parents=True, exist_ok=True)
            self.marker.touch()


def compile_cache(engine_args: dict[str, Any], device: str | None = None) -> CompileCache:
    """Point vLLM's cache root at the per-user, per-version one (``VLLM_CACHE_ROOT`` the user set
    wins) and say whether this engine's graphs are there; call before vLLM starts (its engine
    core process reads the variable from the environment it inherits)."""
    root = os.environ.setdefault("VLLM_CACHE_ROOT", str(cache_root() / "vllm" / versions()))
    key = compile_key(engine_args, gpu_kinds() if device is None else device)
    return CompileCache(root, key, compiles=not engine_args.get("enforce_eager"))
