"""Where a run's output is stored: `output_dir` (and `checkpoint.dir`, `checkpoint.export_dir`)
as a storage location that every node of the run and the user reach, and that outlives the job.

The location is parsed by fsspec, as Ray Train parses its `storage_path`:
- a local path or `file://` URL (a local disk, or NFS / a parallel filesystem mounted at the same
  path on every node) is made absolute once, in the process that plans the run (every actor then
  gets the same absolute path, whatever its own working directory);
- an object store's URL (s3://, gs://, az://, ... any fsspec protocol whose filesystem package is
  installed) is kept as a URL: checkpoints are written straight to it by every rank from its own
  node, and committed by their meta.json written last (an object store has no rename). The
  series a run appends to (metrics, samples, logs) cannot be appended to an object, so
  `output_dir` becomes a local staging folder on the driver's node (:func:`staging_dir`) that is
  uploaded whole (`rlcore.storage.staging`); `storage.url` keeps the URL;
- `memory://` lives inside one process (no other node, nor the user after the run, reaches it)
  and a protocol whose package is missing is refused in one line naming the key.

Inside a Ray Job that ships a working directory (`launch.submit`, `ray job submit
--working-dir`), every node runs the job from its own unpacked copy of that directory, under Ray's
temp dir: an output folder inside it is a different folder on every node (the trainer's part of a
checkpoint stays on the trainer's node) and is deleted with Ray's temp dir. Such a run is refused
before Ray starts (:func:`node_local_problem`): there is no default that is shared on every
cluster (Ray Train also asks for `storage_path` on a multi-node cluster), so the user names one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import tempfile
from pathlib import Path

from rlcore.config.errors import ConfigError

JOB_CONFIG_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"
"""Set by Ray's job supervisor in a Ray Job's driver: the job's runtime_env (its working_dir) as JSON."""
STAGING_ENV = "RLCORE_STAGING_DIR"
"""Where the staging folders of object-store runs live (default: the system temp dir)."""
LOCAL_PROTOCOLS = ("file", "local")
STORAGE_KEYS = ("output_dir", "checkpoint.dir", "checkpoint.export_dir")


def protocol_of(value) -> str | None:
    """The fsspec protocol of a path or URL (None for a plain path)."""
    from fsspec.core import split_protocol

    return split_protocol(str(value).strip())[0]


def is_remote(value) -> bool:
    """Whether `value` (a path, a URL or a path object) names an object store, not a filesystem."""
    if isinstance(value, Path):
        return False
    protocol = getattr(value, "protocol", None) or protocol_of(str(value))  # a UPath knows its own
    return bool(protocol) and protocol not in LOCAL_PROTOCOLS


def storage_path(value):
    """A path object for a location: a `pathlib.Path` for a local path, a `upath.UPath` (the
    pathlib API over the fsspec filesystem) for an object store's URL."""
    if is_remote(value):
        from upath import UPath

        return UPath(str(value).strip().rstrip("/"))
    return Path(str(value)).expanduser()


def local_path(value: str, key: str) -> str:
    """`value` (a path or an fsspec URL) as an absolute local path, or an object store's URL as
    it is (without a trailing slash); ConfigError naming `key` for a protocol a run cannot write
    through. An empty value is returned as it is (the run folder's own check names that problem)."""
    text = str(value).strip()
    if not text:
        return text
    from fsspec.core import split_protocol
    from fsspec.implementations.local import make_path_posix

    protocol, rest = split_protocol(text)
    if protocol is None:
        return str(Path(text).expanduser().absolute())
    if protocol in LOCAL_PROTOCOLS:
        return make_path_posix(rest)
    if protocol == "memory":
        raise ConfigError(
            key,
            f"{text!r}: memory:// lives inside one process, so no other node (nor you, after "
            "the run) reaches it; give a path on storage every node mounts, or an object store's URL "
            "(s3://BUCKET/PATH)",
        )
    from fsspec.registry import get_filesystem_class

    try:
        get_filesystem_class(protocol)
    except ImportError as exc:
        raise ConfigError(
            key,
            f"{text!r}: the {protocol}:// filesystem is not installed ({exc}); for s3:// "
            "pip install 'rlcore[s3]' (s3fs)",
        ) from None
    except ValueError:
        raise ConfigError(
            key,
            f"{text!r}: {protocol}:// is no storage fsspec knows; give a path, or an object "
            "store's URL such as s3://BUCKET/PATH",
        ) from None
    if not rest.strip("/"):
        raise ConfigError(key, f"{text!r} names no bucket or folder")
    return text.rstrip("/")


def staging_dir(url: str, environ=os.environ) -> str:
    """The local staging folder of an object-store `output_dir`: one per URL on this machine
    (`$RLCORE_STAGING_DIR` or the temp dir, then the URL made a folder name plus its hash)."""
    root = environ.get(STAGING_ENV) or os.path.join(tempfile.gettempdir(), "rlcore-staging")
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", url)[-80:]
    return str(Path(root).expanduser().absolute() / f"{slug}-{hashlib.sha256(url.encode()).hexdigest()[:10]}")


def with_local_paths(cfg, environ=os.environ):
    """`cfg` with `output_dir`, `checkpoint.dir` and `checkpoint.export_dir` made absolute local
    paths or object-store URLs (:func:`local_path`); raises ConfigError naming the first key that
    cannot be. An object-store `output_dir` becomes its local staging folder, its URL
    `storage.url`, and `checkpoint.dir` / `checkpoint.export_dir` default to folders under the URL."""
    ckpt = cfg.checkpoint
    out = local_path(cfg.output_dir, "output_dir")
    ckpt_dir = local_path(ckpt.dir, "checkpoint.dir") if ckpt.dir else ckpt.dir
    export = local_path(ckpt.export_dir, "checkpoint.export_dir") if ckpt.export_dir else ckpt.export_dir
    storage = cfg.storage
    if is_remote(out):
        ckpt_dir = ckpt_dir or f"{out}/checkpoints"
        export = export or f"{out}/hf"
        storage = dataclasses.replace(storage, url=out)
        out = staging_dir(out, environ)
    return dataclasses.replace(
        cfg, output_dir=out, storage=storage, checkpoint=dataclasses.replace(ckpt, dir=ckpt_dir, export_dir=export)
    )


def job_working_dir(environ=os.environ) -> Path | None:
    """Inside a Ray Job that ships a working directory: this process's cwd (that directory's copy
    on this node); else None."""
    raw = environ.get(JOB_CONFIG_ENV)
    if not raw:
        return None
    try:
        runtime_env = (json.loads(raw) or {}).get("runtime_env") or {}
    except (ValueError, AttributeError):
        return None
    return Path.cwd().resolve() if runtime_env.get("working_dir") else None


def node_local_problem(cfg, environ=os.environ) -> list[tuple[str, str]]:
    """A storage key whose folder lies inside a Ray Job's working directory: one problem, naming
    the key. Empty outside a Ray Job."""
    work = job_working_dir(environ)
    if work is None:
        return []
    values = (cfg.output_dir, cfg.checkpoint.dir, cfg.checkpoint.export_dir)
    for key, value in zip(STORAGE_KEYS, values):
        if not value or is_remote(value):
            continue
        path = Path(local_path(value, key)).resolve()
        if path == work or work in path.parents:
            return [
                (
                    key,
                    f"{value!r} is inside this Ray Job's working directory ({work}), which every node "
                    "unpacks for itself and Ray deletes with its temp dir: a multi-node run's parts would "
                    "land on different nodes; give an absolute path on storage every node mounts (NFS), "
                    f"e.g. {key}=/shared/runs/NAME",
                )
            ]
    return []
