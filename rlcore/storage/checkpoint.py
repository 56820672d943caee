"""Checkpoints: trainer state through `torch.distributed.checkpoint` (DCP), driver state beside it,
committed atomically.

Layout of one checkpoint, ``{checkpoint.dir}/step_00000012/``::

    trainer/             DCP: {"model": ..., "optim": ...}, sharded (any world size can load it)
    trainer_extra.pt     rank 0: policy version, LR-scheduler state, trainer RNG, world size
    hf/                  rank 0: the model's transformers config + tokenizer (export needs no source)
    driver_state.pt      the driver's state (step, data position, RNG, accounting, ...)
    meta.json            written last: step, mode, time; its presence marks a complete checkpoint

Every rank's part. Rank 0 lists every file the checkpoint needs (each rank's DCP shards from
DCP's own metadata, with the bytes each must hold; its own files); the driver commits only when
it sees every one of them on the storage (a rank that wrote to a node-local folder fails the save
with one error, and nothing is "saved"), and meta.json keeps the list: a checkpoint missing a part
later is not complete, so resume takes the newest complete one.

Atomicity. Everything is written into ``.tmp-step_00000012-<nonce>/`` next to the committed
checkpoints and then renamed in one ``os.rename``; a crash while saving leaves a ``.tmp-*``
directory that is never read and is removed by the next run. Deleting an old checkpoint first
renames it to ``.tmp-*`` as well, so a half-deleted checkpoint is never mistaken for a good one.
All ranks must write to a filesystem the driver sees (`rlcore.storage.location`).

In an object store (s3://, ...: no rename) every rank writes straight into ``step_00000012/``
through DCP's fsspec writer, and meta.json, written last by the driver once it sees every part
there, is the commit: a prefix without it is never read, and the next run deletes it. Deleting
or replacing a checkpoint removes its meta.json first.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from rlcore.storage.checkpoint_dirs import (  # noqa: F401  (re-exported: the directory side lives there)
    DRIVER_STATE,
    HF_DIR,
    META,
    PARTS,
    TRAINER_DIR,
    TRAINER_EXTRA,
    checkpoint_root,
    config_problems,
    fresh,
    is_complete,
    latest_checkpoint,
    list_checkpoints,
    missing_parts,
    plain_load_problem,
    read_meta,
    resolve_resume,
    resume_request,
    step_dir_name,
)
from rlcore.storage.commit import commit_dir, remove_dir, remove_tree, temp_dir_for  # noqa: F401  (re-exported)
from rlcore.storage.hf_files import save_config_and_tokenizer
from rlcore.storage.location import is_remote, storage_path
from rlcore.storage.rundir import truncate_series  # noqa: F401  (re-exported: the series live in the run folder)
from rlcore.storage.staging import NoAnswer, upload_within, within

log = logging.getLogger("rlcore")


class IncompleteCheckpoint(RuntimeError):
    """A part a trainer rank wrote is not on the storage as the driver sees it."""


class CheckpointWriter:
    """Driver side of saving: temp dir, commit, `keep_last` pruning."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.root = checkpoint_root(cfg)

    def _store(self, what: str, work):
        """`work()` as is on a filesystem; in an object store bounded by `checkpoint.timeout_s`
        and named after a few seconds (`rlcore.storage.staging.within`): a store that stopped
        answering is `NoAnswer` naming it, never a driver that waits in silence."""
        if not is_remote(self.root):
            return work()
        return within(work, float(self.cfg.checkpoint.timeout_s), f"checkpoint: {what}", str(self.root))

    def due(self, step: int, final: bool) -> bool:
        c = self.cfg.checkpoint
        return (c.interval > 0 and step % c.interval == 0) or (final and c.save_final)

    def clean_stale(self) -> None:
        """Remove leftovers of interrupted saves (call once, before the first save): `.tmp-*`
        folders, and in an object store the step prefixes without their meta.json."""
        if not fresh(self.root).is_dir():
            return
        for p in self.root.iterdir():
            stale = p.name.startswith(".tmp-") or (
                is_remote(p) and p.name.startswith("step_") and not (p / META).is_file()
            )
            if stale:
                log.warning("removing %s: an interrupted checkpoint save", p)
                remove_tree(p)

    def begin(self, step: int) -> Path:
        """The folder the ranks write `step`'s checkpoint into: a temporary folder renamed at
        the commit, or in an object store the final prefix itself (emptied, uncommitted first)."""
        final = self.root / step_dir_name(step)
        if is_remote(final):
            self._store(f"clearing {final.name} in", lambda: fresh(final).exists() and remove_dir(final))
            return final
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = temp_dir_for(final)
        tmp.mkdir()
        return tmp

    def commit(self, tmp: Path, step: int, driver_state: dict[str, Any], parts: dict[str, int]) -> Path:
        """Check that `tmp` holds every part the ranks wrote (`parts`: relative path -> bytes;
        IncompleteCheckpoint naming the first missing ones, nothing committed), write the driver
        state and the completion marker (which lists the parts) into `tmp`, then rename it (in an
        object store, the marker written last is the commit)."""
        final = self._store(f"committing {tmp.name} in", lambda: self._commit(tmp, step, driver_state, parts))
        if self.cfg.storage.url:  # the series as far as this checkpoint, beside it in the store (bounded:
            # the checkpoint is committed; a store that does not answer costs a line, not the run)
            upload_within(self.cfg, self.cfg.checkpoint.timeout_s, f"uploading the run's files of step {step}")
        return final

    def _commit(self, tmp: Path, step: int, driver_state: dict[str, Any], parts: dict[str, int]) -> Path:
        missing = missing_parts(fresh(tmp), parts)
        if missing:
            raise IncompleteCheckpoint(
                f"{len(missing)} of the {len(parts)} files the trainer ranks wrote are not in {tmp} as the driver "
                f"sees it ({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}): every node must reach "
                "the run's storage (output_dir / checkpoint.dir on a filesystem every node mounts, or an object store)"
            )
        with (tmp / DRIVER_STATE).open("wb") as fh:
            torch.save(driver_state, fh)
        parts = {**parts, DRIVER_STATE: (tmp / DRIVER_STATE).stat().st_size}
        meta = {"step": step, "mode": self.cfg.mode, "time": time.time(), PARTS: parts, "config": _plain(self.cfg)}
        (tmp / META).write_text(json.dumps(meta, indent=1, default=str))
        final = tmp if is_remote(tmp) else commit_dir(tmp, self.root / step_dir_name(step))
        self.prune()
        return final

    def abort(self, tmp: Path) -> None:
        """Remove an uncommitted save. In an object store bounded like the save (a store that
        does not answer leaves the prefix, which is never listed: the next run removes it)."""

        def remove():
            if is_remote(tmp) and (fresh(tmp) / META).is_file():
                return  # committed (in the store the folder is the final one): what failed came after
            remove_tree(tmp)

        try:
            self._store(f"removing the uncommitted {tmp.name} from", remove)
        except NoAnswer as exc:
            log.warning("%s; the next run removes it", exc)

    def prune(self) -> None:
        keep = self.cfg.checkpoint.keep_last
        if keep <= 0:
            return
        for _, path in list_checkpoints(self.root)[:-keep]:
            remove_dir(path)


def _plain(cfg) -> Any:
    from omegaconf import OmegaConf

    try:
        return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)
    except Exception:  # a hand-built config in a test: the meta file is informational
        return str(cfg)


def _torch_load(path) -> Any:
    with storage_path(path).open("rb") as fh:
        return torch.load(fh, weights_only=False)


def _torch_save(obj: Any, path) -> None:
    with path.open("wb") as fh:
        torch.save(obj, fh)


def load_driver_state(path: Path) -> dict[str, Any]:
    return _torch_load(storage_path(path) / DRIVER_STATE)


def config_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Dotted keys whose value changed since the checkpoint (bookkeeping keys excluded)."""
    skip = ("output_dir", "steps", "checkpoint", "logger", "cluster", "eval", "recipe")
    out: list[str] = []

    def walk(a, b, prefix):
        if isinstance(a, dict) and isinstance(b, dict):
            for k in sorted(set(a) | set(b)):
                if not prefix and k in skip:
                    continue
                walk(a.get(k), b.get(k), f"{prefix}{k}.")
        elif a != b:
            out.append(prefix.rstrip("."))

    walk(saved, current, "")
    return out


# -- process RNG -------------------------------------------------------------------------------
def rng_state() -> dict[str, Any]:
    import numpy as np

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    import numpy as np

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# -- trainer side (every rank, collectively) ---------------------------------------------------
@contextlib.contextmanager
def _dcp_call(what: str):
    """Around a DCP save/load: silence its single-process warning (intended here), and turn its
    `CheckpointException` (a BaseException: Ray would treat it like an interpreter exit) into a
    RuntimeError that names the operation and the first rank's error."""
    from torch.distributed.checkpoint.api import CheckpointException

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            yield
        except CheckpointException as exc:
            failures = getattr(exc, "failures", {}) or {}
            first = next(iter(failures.items()), None)
            detail = f"rank {first[0]}: {type(first[1]).__name__}: {first[1]}" if first else str(exc).splitlines()[0]
            raise RuntimeError(f"{what} failed ({detail})") from exc


def _dcp_storage(ckpt_dir, writer: bool) -> dict[str, Any]:
    """DCP's keyword for the trainer folder of `ckpt_dir`: its path (a filesystem), or its fsspec
    writer/reader (an object store; DCP's own FileSystemWriter would take the URL for a path)."""
    where = str(storage_path(ckpt_dir) / TRAINER_DIR)
    if not is_remote(ckpt_dir):
        return {"checkpoint_id": where}
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    return {"storage_writer": FsspecWriter(where)} if writer else {"storage_reader": FsspecReader(where)}


def _state_dicts(core):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    # sharded (DTensor) model and optimizer state; get_state_dict also creates the optimizer's
    # state before the first step, so loading into a fresh optimizer finds every key
    model_sd, optim_sd = get_state_dict(core.model, core.optimizer)
    return {"model": model_sd, "optim": optim_sd}


def save_trainer(core, ckpt_dir: str | Path) -> dict[str, int]:
    """Save this rank's shard of model + optimizer (collective over the trainer group); rank 0
    also writes the small replicated state and the model's config and tokenizer. Returns, on
    rank 0, every file the checkpoint's trainer side needs ({relative path: bytes}: every rank's
    shards from DCP's metadata, the metadata, rank 0's files); {} on the other ranks."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    ckpt_dir = storage_path(ckpt_dir)
    with _dcp_call(f"checkpoint save to {ckpt_dir}"):
        metadata = dcp.save(
            _state_dicts(core), **_dcp_storage(ckpt_dir, writer=True), no_dist=not dist.is_initialized()
        )
    if core.rank != 0:
        return {}
    scheduler = getattr(core, "scheduler", None)
    _torch_save(
        {
            "version": core.version,
            "world_size": core.world_size,
            "scheduler": scheduler.state_dict() if scheduler is not None else None,
            "rng": rng_state(),
        },
        ckpt_dir / TRAINER_EXTRA,
    )
    if is_remote(ckpt_dir):  # transformers writes a folder: write it here, then upload it
        import tempfile

        with tempfile.TemporaryDirectory(prefix="rlcore-hf-") as local:
            save_config_and_tokenizer(core.model, core.tokenizer, Path(local), core.cfg.model.dtype)
            ckpt_dir.fs.put(f"{local}/", (ckpt_dir / HF_DIR).path, recursive=True)
    else:
        save_config_and_tokenizer(core.model, core.tokenizer, ckpt_dir / HF_DIR, core.cfg.model.dtype)
    return trainer_parts(ckpt_dir, metadata)


def trainer_parts(ckpt_dir: Path, metadata) -> dict[str, int]:
    """{relative path: bytes} of the trainer side of a checkpoint: each shard file DCP's metadata
    names (every rank's, with the bytes its entries end at), then the files in `ckpt_dir` as
    this process sees them (the DCP metadata, rank 0's state and HF files). The HF folder's
    files (config, tokenizer: text a user may edit) only need to exist (0 bytes)."""
    parts: dict[str, int] = {}
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        rel = f"{TRAINER_DIR}/{info.relative_path}"
        parts[rel] = max(parts.get(rel, 0), int(info.offset) + int(info.length))
    if is_remote(ckpt_dir):
        fs, root = ckpt_dir.fs, ckpt_dir.path.rstrip("/")
        for key, info in fs.find(root, detail=True).items():
            rel = key[len(root) + 1 :] if key.startswith(root + "/") else key
            parts.setdefault(rel, 0 if rel.startswith(f"{HF_DIR}/") else int(info.get("size") or 0))
        return parts
    for dirpath, _, files in os.walk(ckpt_dir):
        for name in files:
            rel = os.path.relpath(os.path.join(dirpath, name), ckpt_dir)
            size = 0 if rel.startswith(f"{HF_DIR}/") else os.path.getsize(os.path.join(dirpath, name))
            parts.setdefault(rel, size)
    return parts


def load_trainer(core, ckpt_dir: str | Path) -> int:
    """Load model + optimizer (resharded to this group's world size) and the replicated state;
    returns the restored policy version. Collective over the trainer group."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    ckpt_dir = storage_path(ckpt_dir)
    sd = _state_dicts(core)
    with _dcp_call(f"checkpoint load from {ckpt_dir}"):
        dcp.load(sd, **_dcp_storage(ckpt_dir, writer=False), no_dist=not dist.is_initialized())
    set_state_dict(core.model, core.optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    extra = _torch_load(ckpt_dir / TRAINER_EXTRA)
    core.version = int(extra["version"])
    scheduler = getattr(core, "scheduler", None)
    if scheduler is not None and extra.get("scheduler") is not None:
        scheduler.load_state_dict(extra["scheduler"])
    set_rng_state(extra["rng"])
    return core.version


def load_model_weights(model: torch.nn.Module, ckpt_dir: str | Path) -> None:
    """Load a checkpoint's model weights into a plain (unsharded) module in one process: export,
    evaluation engines. Only the model's entries are read."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    sd = {"model": model.state_dict()}
    no_dist = not (dist.is_available() and dist.is_initialized())
    with _dcp_call(f"loading model weights from {ckpt_dir}"):
        dcp.load(sd, **_dcp_storage(ckpt_dir, writer=False), no_dist=no_dist)
    model.load_state_dict(sd["model"])


def read_trainer_extra(ckpt_dir: str | Path) -> dict[str, Any]:
    return _torch_load(storage_path(ckpt_dir) / TRAINER_EXTRA)


# -- metrics series on resume ------------------------------------------------------------------
