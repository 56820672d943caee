"""Where a run's output is stored: `output_dir` (and `checkpoint.dir`, `checkpoint.export_dir`)
as a storage location that every node of the run and the user reach, and that outlives the job.

The location is parsed by fsspec, as Ray Train parses its `storage_path`: a local path, a
`file://` URL, or another protocol's URL. A run writes its series by appending, takes a `flock`
on its folder and commits a checkpoint with one `rename`: what a POSIX filesystem gives (a local
disk, or NFS / a parallel filesystem mounted at the same path on every node), not what an object
store gives. So a local path or `file://` URL is accepted and made absolute once, in the
process that plans the run (every actor then gets the same absolute path, whatever its own
working directory); another protocol is refused in one line naming the key. `memory://` in
particular lives inside one process: no other node can reach it.

Inside a Ray Job that ships a working directory (`launch.submit`, `ray job submit
--working-dir`), every node runs the job from its own unpacked copy of that directory, under Ray's
temp dir: an output folder inside it is a different folder on every node (the trainer's part of a
checkpoint stays on the trainer's node) and is deleted with Ray's temp dir. Such a run is refused
before Ray starts (:func:`node_local_problem`): there is no default that is shared on every
cluster (Ray Train also asks for `storage_path` on a multi-node cluster), so the user names one.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from rlcore.config.errors import ConfigError

JOB_CONFIG_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"
"""Set by Ray's job supervisor in a Ray Job's driver: the job's runtime_env (its working_dir) as JSON."""
LOCAL_PROTOCOLS = ("file", "local")
STORAGE_KEYS = ("output_dir", "checkpoint.dir", "checkpoint.export_dir")


def local_path(value: str, key: str) -> str:
    """`value` (a path or an fsspec URL) as an absolute local path; ConfigError naming `key` for
    a protocol a run cannot write through. An empty value is returned as it is (the run folder's
    own check names that problem)."""
    text = str(value).strip()
    if not text:
        return text
    from fsspec.core import split_protocol
    from fsspec.implementations.local import make_path_posix

    protocol, rest = split_protocol(text)
    if protocol is None:
        return str(Path(text).expanduser().absolute())
    if protocol not in LOCAL_PROTOCOLS:
        reach = ("lives inside one process, so no other node (nor you, after the run) reaches it"
                 if protocol == "memory" else
                 "is an object store: a run appends its series, locks its folder and commits checkpoints "
                 "with a rename, which need a filesystem")
        raise ConfigError(key, f"{text!r}: {protocol}:// {reach}; give a path on storage every node mounts "
                          "(a local disk for one node; NFS or a parallel filesystem for several), as a path or "
                          "file:// URL")
    return make_path_posix(rest)


def with_local_paths(cfg):
    """`cfg` with `output_dir`, `checkpoint.dir` and `checkpoint.export_dir` made absolute local
    paths (:func:`local_path`); raises ConfigError naming the first key that cannot be."""
    ckpt = cfg.checkpoint
    out = local_path(cfg.output_dir, "output_dir")
    ckpt_dir = local_path(ckpt.dir, "checkpoint.dir") if ckpt.dir else ckpt.dir
    export = local_path(ckpt.export_dir, "checkpoint.export_dir") if ckpt.export_dir else ckpt.export_dir
    return dataclasses.replace(cfg, output_dir=out,
                               checkpoint=dataclasses.replace(ckpt, dir=ckpt_dir, export_dir=export))


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
        if not value:
            continue
        path = Path(local_path(value, key)).resolve()
        if path == work or work in path.parents:
            return [(key, f"{value!r} is inside this Ray Job's working directory ({work}), which every node "
                     "unpacks for itself and Ray deletes with its temp dir: a multi-node run's parts would "
                     "land on different nodes; give an absolute path on storage every node mounts (NFS), "
                     f"e.g. {key}=/shared/runs/NAME")]
    return []
