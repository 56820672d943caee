"""The run folder (`output_dir`): checked before Ray starts, so a run never dies on it later
and two runs never share one folder.

- It must be creatable and writable by this process (`/proc/x`, `/sys/x`, a file's path are not).
- A fresh run refuses a folder that already holds a run (its metrics, checkpoints or eval
  results): the new run would append to the old series and resume or export stale checkpoints.
  `resume=true` continues the run that is there; otherwise choose another folder.
- An empty `output_dir` is refused (it would train into the current directory).
- A run holds its folder for its whole life (:func:`hold_output_dir`, an exclusive `flock` on
  `OUTPUT_DIR/.lock`): a second run started into it while the first one still runs is refused,
  however close together they started. The kernel drops the lock when the holder's file
  descriptor closes, so a crashed or killed run never leaves its folder locked.
- A resume (`resume=true`) that finds no complete checkpoint in a folder whose series hold rows
  is refused (:func:`rows_without_checkpoint`): it would start at step 0 and either drop those
  rows or append a second series after them. A resume never deletes what an earlier attempt
  logged; with no rows it starts fresh.
- The folder is a storage location every node reaches (:mod:`.location`): made absolute before
  the run starts, and refused inside a Ray Job's node-local working directory. For an
  object-store `output_dir` it is the run's local staging folder, refilled from the URL before
  these checks and uploaded during the run (:mod:`.staging`).
"""

from __future__ import annotations

import fcntl
import logging
import os
import tempfile
import uuid
from pathlib import Path
from typing import IO

from omegaconf import OmegaConf

from rlcore.config.errors import ConfigError
from rlcore.config.nodes import to_node
from rlcore.config.schema import RunConfig
from rlcore.storage.checkpoint_dirs import checkpoint_root, latest_checkpoint, list_checkpoints, resume_request
from rlcore.storage.location import node_local_problem
from rlcore.storage.series import read_rows

log = logging.getLogger("rlcore")

LOCK_FILE = ".lock"
"""Held (flock) by the run writing into the folder; it holds that run's pid."""
SERIES_FILES = ("metrics.jsonl", "data_order.jsonl", "samples.jsonl")
"""Per-step JSONL series a run appends to; a resume cuts them back to its checkpoint's step."""

RUN_FILES = ("metrics.jsonl", "eval_results.json")
"""Results a run writes into `output_dir`; any of them marks the folder as holding a run (a
`config.yaml` alone is a run that stopped before its first step: the folder may be reused)."""


def not_writable(out: Path) -> str | None:
    """Why `out` cannot be created or written, or None. Creates nothing: it probes the nearest
    existing ancestor with a temporary directory that is removed at once."""
    probe = out
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    if not probe.is_dir():
        return f"{str(probe)!r} is not a directory, so {str(out)!r} cannot be created"
    try:
        with tempfile.TemporaryDirectory(dir=probe, prefix=".rlcore-probe-"):
            pass
    except OSError as exc:
        where = "written" if probe == out else f"created (in {str(probe)!r})"
        return f"{str(out)!r} cannot be {where}: {exc.strerror or exc}"
    return None


def previous_run(cfg) -> str | None:
    """What in `output_dir` (or `checkpoint.dir`) shows that a run was already there, or None."""
    out = Path(cfg.output_dir).expanduser()
    for name in RUN_FILES:
        if (out / name).is_file():
            return name
    found = list_checkpoints(checkpoint_root(cfg))
    if found:
        return f"checkpoint {found[-1][1]}"
    return None


def output_dir_problems(cfg) -> list[tuple[str, str]]:
    """`output_dir` is writable, and a fresh run does not reuse another run's folder."""
    if not str(cfg.output_dir or "").strip():
        return [
            (
                "output_dir",
                "is empty, which would write the run into the current directory; name a folder "
                "(e.g. output_dir=outputs/run1)",
            )
        ]
    node_local = node_local_problem(cfg)
    if node_local:
        return node_local
    out = Path(cfg.output_dir).expanduser()
    why = not_writable(out)
    if why:
        return [("output_dir", why)]
    rows = rows_without_checkpoint(cfg)
    if rows:
        return [("checkpoint.resume", rows)]
    held = previous_run(cfg)
    if held is None:
        return []
    if cfg.mode == "eval":  # an evaluation never continues: each one gets its own folder
        return [("output_dir", f"{cfg.output_dir!r} already holds a run ({held}); choose a new output_dir")]
    if resume_request(cfg) is None:
        return [
            (
                "output_dir",
                f"{cfg.output_dir!r} already holds a run ({held}); continue it with resume=true, "
                "or choose a new output_dir",
            )
        ]
    return []


def truncate_series(path: Path, step: int, drop_eval_at_step: bool = False) -> int:
    """Drop rows of a JSONL series logged after checkpoint `step` (the run went on past its last
    checkpoint before it stopped), so the resumed run continues the same series without
    duplicates. With `drop_eval_at_step`, evaluation rows of `step` itself go too (that
    evaluation is re-run). A line that does not parse is a row cut short (a run stopped or a disk
    filled mid-write): dropped with one warning, never kept. Returns the rows removed (after the
    checkpoint); rewrites atomically."""
    rows, broken = read_rows(path)
    keep, removed = [], 0
    for line, row in rows:
        try:
            s = int(row.get("step", -1))
        except (ValueError, TypeError):
            s = -1  # a row without a step number is kept as it is
        is_eval = any(str(k).startswith("eval/") for k in row)
        if s > step or (drop_eval_at_step and is_eval and s == step):
            removed += 1
        else:
            keep.append(line)
    if broken:
        log.warning(
            "resume: %s: dropped %d line(s) that are not whole JSON rows (a row cut short when the run "
            "stopped or its disk filled)",
            path,
            broken,
        )
    if removed or broken:
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
        tmp.write_text("".join(line + "\n" for line in keep))
        os.replace(tmp, path)
    return removed


class FolderInUse(RuntimeError):
    """Another live process holds the run folder."""


def hold_output_dir(out: Path) -> IO:
    """Take `out`'s run lock: an exclusive, non-blocking `flock` on `out/.lock`, which then
    holds this pid. Returns the open lock file: the lock lasts while it stays open (close it at
    the end of the run; exit or a crash closes it too). Raises FolderInUse naming the holder."""
    out.mkdir(parents=True, exist_ok=True)
    lock = open(out / LOCK_FILE, "a+")
    try:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "unknown"
        lock.close()
        raise FolderInUse(
            f"{str(out)!r} is in use by another run (pid {holder}); wait for it to finish, or choose another output_dir"
        ) from None
    lock.seek(0)
    lock.truncate()
    lock.write(f"{os.getpid()}\n")
    lock.flush()
    return lock


def series_rows(path: Path) -> int:
    """Non-empty lines of a JSONL series (0 when the file is absent or unreadable)."""
    try:
        with open(path, "rb") as fh:
            return sum(1 for line in fh if line.strip())
    except OSError:
        return 0


def rows_without_checkpoint(cfg) -> str | None:
    """Why `resume=true` must not run here, or None: it finds no complete checkpoint, yet the
    folder's series hold rows an earlier attempt logged (starting at step 0 would drop them or
    append a second series). Only for `resume=true`/`latest` in RL (a path is checked as such)."""
    if cfg.mode != "rl" or resume_request(cfg) != "latest" or latest_checkpoint(checkpoint_root(cfg)) is not None:
        return None
    out = Path(cfg.output_dir).expanduser()
    held = [(name, series_rows(out / name)) for name in SERIES_FILES]
    held = [f"{n} row(s) of {name}" for name, n in held if n]
    if not held:
        return None
    return (
        f"true found no complete checkpoint in {checkpoint_root(cfg)}, but {str(out)!r} holds "
        f"{', '.join(held)} of an earlier run; resuming would start at step 0 over them, so nothing was "
        "changed: keep them and choose a new output_dir, or resume=PATH from a checkpoint kept elsewhere"
    )


def last_checkpoint_hint(cfg) -> str:
    """Where a stopped run can continue from, in a few words."""
    path = latest_checkpoint(checkpoint_root(cfg))
    return f"last checkpoint: {path} (resume=true continues from it)" if path else "no checkpoint was written yet"


def claim_output_dir(cfg: RunConfig) -> tuple[Path, IO]:
    """Create `output_dir`, take its run lock (`hold_output_dir`: a folder another
    live run holds is refused), and write the composed config as config.yaml. Returns (folder, the open lock); ConfigError
    naming `output_dir` when the folder is held, or cannot be made or written."""
    out = Path(cfg.output_dir).expanduser()
    try:
        lock = hold_output_dir(out)
    except FolderInUse as exc:
        raise ConfigError("output_dir", str(exc)) from None
    except OSError as exc:
        raise ConfigError("output_dir", f"{cfg.output_dir!r}: {exc.strerror or exc}") from None
    try:
        OmegaConf.save(to_node(cfg), out / "config.yaml")
    except OSError as exc:
        lock.close()
        raise ConfigError("output_dir", f"{cfg.output_dir!r}: {exc.strerror or exc}") from None
    return out, lock
