"""Actor output goes to the run folder, not the console.

Ray streams every worker's stdout/stderr to the driver's console unless told otherwise; here the
driver starts Ray with `log_to_driver=False` and each actor sends its file descriptors 1 and 2 to
`OUTPUT_DIR/logs/KIND-INDEX.log` (so progress bars, library warnings and C++ logs such as abseil's
`mutex.cc ... RAW:` lines land there). Errors still reach the user: a failing remote call
raises on the driver, which prints one line and points to this folder.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from rlcore.report.console import ACTOR_LOG_DIR, actor_log_path

# settings for every actor process; passed through the actors' runtime_env
QUIET_ENV = {
    "TQDM_DISABLE": "1",  # "Loading weights" and download bars: noise even in a file
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
}


def runtime_env() -> dict:
    """The runtime_env of every trainer and rollout actor."""
    # NVLink SHARP (NVLS) multicast is unreliable on the lent machines; keep it off everywhere
    # QUIET_ENV: progress bars and C++ info logs off (actors' output goes to OUTPUT_DIR/logs)
    return {"env_vars": {"NCCL_NVLS_ENABLE": "0", "TOKENIZERS_PARALLELISM": "false", **QUIET_ENV}}


def redirect_output(output_dir: str, kind: str, index: int) -> Path:
    """Send this process's stdout and stderr (Python and native writes alike) to
    `OUTPUT_DIR/logs/KIND-INDEX.log`, appending (a restarted actor continues its file)."""
    path = actor_log_path(output_dir, kind, index)
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    return path


CLUSTER_ERRORS = "ray-errors.log"
"""File under OUTPUT_DIR/logs/ that holds the cluster's own error reports (`route_cluster_errors`)."""


def route_cluster_errors(output_dir: str) -> Path | None:
    """Ray's driver prints each error report the cluster publishes (a node declared dead, a
    worker killed, a raylet's stack trace) to the console in full, whatever `log_to_driver` says:
    a frozen node's return used to leave two 20-line raylet tracebacks among the run's lines.
    Here each report's whole text goes to OUTPUT_DIR/logs/ray-errors.log and the console gets one
    line (the driver names the fault itself, as its own lines do). Ray's other output is left as
    it is. Returns the file, or None where this Ray has no such printer (left unchanged)."""
    import logging

    import ray._private.worker as ray_worker

    printer = getattr(ray_worker, "print_to_stdstream", None)
    if printer is None:
        return None
    original = getattr(printer, "rlcore_original", printer)
    path = Path(output_dir) / ACTOR_LOG_DIR / CLUSTER_ERRORS
    log = logging.getLogger("rlcore")
    said: set[int] = set()

    def routed(data, *args, **kwargs):
        if data.get("pid") != "raylet":  # a worker's own output: Ray's handling
            return original(data, *args, **kwargs)
        text = "\n".join(str(line) for line in data.get("lines", []))
        if hash(text) in said:  # one killed raylet came as two identical reports: the second says nothing new
            return None
        said.add(hash(text))
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            f.write(text.rstrip("\n") + "\n\n")
        first = next((line.strip() for line in text.splitlines() if line.strip()), "(empty)")
        log.info("Ray reported: %s (whole report: %s)", first[:200], path)

    routed.rlcore_original = original
    ray_worker.print_to_stdstream = routed
    return path
