"""What the user sees on the driver's console besides the step lines: quiet Ray start-up
settings and run errors condensed to one line that points to the actors' log files."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

from rlcore.config.errors import ConfigError

ACTOR_LOG_DIR = "logs"

# "ValueError: boom", "ray.exceptions.RayActorError: ...", "torch.OutOfMemoryError: ..."
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Failure)\b")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # Ray colours the remote function's name
_ACTOR_NAME = re.compile(r"\b(trainer rank|rollout actor) (\d+)\b")


def actor_log_path(output_dir: str, kind: str, index: int) -> Path:
    """`OUTPUT_DIR/logs/KIND-INDEX.log`: where actor `kind` (trainer, rollout) `index` writes
    its stdout and stderr (actors.logs.redirect_output)."""
    return Path(output_dir) / ACTOR_LOG_DIR / f"{kind}-{index}.log"


def quiet_ray_environment() -> None:
    """Environment for a Ray cluster this process starts; Ray reads it at `ray.init`."""
    # naming the auth mode Ray picks anyway (token) keeps it from warning on every run
    os.environ.setdefault("RAY_AUTH_MODE", "token")


def one_line(text: str) -> str:
    """A multi-line error (a remote traceback inside a RunError) as one line: the first line,
    then the last exception line and what follows it (the driver appends its resume hint
    there); a text that is already one line is returned unchanged."""
    lines = [ln.strip() for ln in _ANSI.sub("", text).strip().splitlines() if ln.strip()]
    if len(lines) <= 1:
        return lines[0] if lines else ""
    last_exc = max((i for i, ln in enumerate(lines) if _EXCEPTION_LINE.match(ln)), default=None)
    if last_exc is None or last_exc == 0:
        return f"{lines[0]} ... {lines[-1]}"
    return f"{lines[0]} ... {' '.join(lines[last_exc:])}"


def actor_log_hint(message: str, output_dir: str) -> str:
    """Where the failing actor's output is: its file when the message names exactly one actor
    (`trainer rank N`, `rollout actor N`), else the folder of all of them."""
    names = {(kind, int(i)) for kind, i in _ACTOR_NAME.findall(message)}
    if len(names) == 1:
        kind, i = names.pop()
        return f"actor log: {actor_log_path(output_dir, 'trainer' if kind == 'trainer rank' else 'rollout', i)}"
    return f"logs: {Path(output_dir) / ACTOR_LOG_DIR}/"


def error_line(message: str, output_dir: str) -> str:
    """The console line for a run error: condensed message, then where the logs are."""
    return f"rlcore: error: {one_line(message)} ({actor_log_hint(message, output_dir)})"


def log_error_detail(output_dir: str, text: str) -> None:
    """Append `text` (an error's whole detail: remote tracebacks) to `OUTPUT_DIR/logs/errors.log`;
    a log that cannot be written (a full disk) is left out."""
    path = Path(output_dir) / ACTOR_LOG_DIR / "errors.log"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            f.write(text.rstrip() + "\n\n")
    except OSError:
        pass


def report_error(message: str, output_dir: str) -> str:
    """Append the whole error text (remote tracebacks included) to `OUTPUT_DIR/logs/errors.log`
    and return the one console line for it; a log that cannot be written is left out."""
    log_error_detail(output_dir, message)
    return error_line(message, output_dir)


EXIT_CONFIG = 2


def report_config_error(exc: ConfigError) -> int:
    """Every problem on its own line, the first one first; exit code 2."""
    for line in exc.lines():
        print(f"rlcore: config error: {line}", file=sys.stderr)
    return EXIT_CONFIG
