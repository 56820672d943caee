"""The run folder (`output_dir`): checked before Ray starts, so a run never dies on it later
and two runs never share one folder.

- It must be creatable and writable by this process (`/proc/x`, `/sys/x`, a file's path are not).
- A fresh run refuses a folder that already holds a run (its metrics, checkpoints or eval
  results): the new run would append to the old series and resume or export stale checkpoints.
  `resume=true` continues the run that is there; otherwise choose another folder.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from rlcore.checkpoint_dirs import checkpoint_root, list_checkpoints, resume_request

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
    out = Path(cfg.output_dir).expanduser()
    why = not_writable(out)
    if why:
        return [("output_dir", why)]
    held = previous_run(cfg)
    if held is None:
        return []
    if cfg.mode == "eval":  # an evaluation never continues: each one gets its own folder
        return [("output_dir", f"{cfg.output_dir!r} already holds a run ({held}); choose a new output_dir")]
    if resume_request(cfg) is None:
        return [("output_dir", f"{cfg.output_dir!r} already holds a run ({held}); continue it with resume=true, "
                 "or choose a new output_dir")]
    return []
