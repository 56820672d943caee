"""What `launch.submit` sends with a job: the runtime_env (the repository as the working dir, the
lock's pins for Ray's uv plugin), the entrypoint, the submission id, and the check that the run's
output is not left in the job's node-local working dir."""

from __future__ import annotations

import datetime
import os
import re
import secrets
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any, Optional, Sequence

from launch.jobs_api import LaunchError

REPO_ROOT = Path(__file__).resolve().parent.parent

# Never worth shipping: environments, caches, run outputs, VCS data, GPU staging. Ray also honours
# .gitignore files, but the repository may not ignore everything here (e.g. a local outputs/).
WORKING_DIR_EXCLUDES = [
    ".venv/",
    ".git/",
    ".gpu-stage/",
    "outputs/",
    "multirun/",
    "wandb/",
    "**/__pycache__/",
    "*.pyc",
    ".pytest_cache/",
    ".hypothesis/",
    ".ruff_cache/",
    ".mypy_cache/",
]


def locked_requirements(extras: Sequence[str], repo_root: Path = REPO_ROOT) -> list[str]:
    """The exact pins of uv.lock for a runtime (no dev group, no project), one requirement each."""
    uv = shutil.which("uv")
    if uv is None:
        raise LaunchError(
            "`uv` is not on PATH, so uv.lock cannot be exported for --deps lock; install uv, or "
            "pass --deps preinstalled if the cluster already has the environment"
        )
    cmd = [
        uv,
        "export",
        "--frozen",
        "--format",
        "requirements.txt",
        "--no-dev",
        "--no-emit-project",
        "--no-hashes",
        "--no-header",
        "--no-annotate",
    ]
    for extra in extras:
        cmd += ["--extra", extra]
    try:
        proc = subprocess.run(cmd, cwd=repo_root, capture_output=True, text=True, timeout=120, check=False)
    except subprocess.TimeoutExpired:
        raise LaunchError("`uv export` did not finish within 120 s") from None
    if proc.returncode != 0:
        detail = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "no output"
        raise LaunchError(f"`uv export` failed (exit {proc.returncode}): {detail}")
    pins = [
        line.strip() for line in proc.stdout.splitlines() if line.strip() and not line.lstrip().startswith(("#", "-"))
    ]
    if not pins:
        raise LaunchError("`uv export` produced no requirements; is uv.lock empty?")
    return pins


def git_ignored(repo_root: Path = REPO_ROOT) -> list[str]:
    """What git ignores under `repo_root` (its .gitignore files, .git/info/exclude and the user's
    global excludes), as anchored patterns for `runtime_env["excludes"]`: Ray itself reads only
    .gitignore files, so a folder excluded in .git/info/exclude (staged wheels, a local dataset)
    would be zipped and uploaded with every job. Empty when git or the repository is missing."""
    git = shutil.which("git")
    if git is None or not (repo_root / ".git").exists():
        return []
    cmd = [git, "-C", str(repo_root), "ls-files", "--others", "--ignored", "--exclude-standard", "--directory", "-z"]
    try:
        proc = subprocess.run(cmd, capture_output=True, timeout=30, check=False)
    except (subprocess.TimeoutExpired, OSError):
        return []
    if proc.returncode != 0:
        return []
    return ["/" + p for p in proc.stdout.decode(errors="surrogateescape").split("\0") if p]


def build_runtime_env(
    deps: str,
    extras: Sequence[str],
    env_vars: dict[str, str],
    repo_root: Path = REPO_ROOT,
) -> dict[str, Any]:
    runtime_env: dict[str, Any] = {
        "working_dir": str(repo_root),
        "excludes": list(WORKING_DIR_EXCLUDES) + git_ignored(repo_root),
    }
    if deps == "lock":
        runtime_env["uv"] = {"packages": locked_requirements(extras, repo_root)}
    if env_vars:
        runtime_env["env_vars"] = dict(env_vars)
    return runtime_env


def entrypoint_for(overrides: Sequence[str]) -> str:
    return shlex.join(["python", "-m", "rlcore.run", *overrides])


def default_submission_id(overrides: Sequence[str]) -> str:
    recipe = "default"
    for item in overrides:
        if item.startswith(("+recipe=", "recipe=", "++recipe=")):
            recipe = re.sub(r"[^A-Za-z0-9_-]", "-", item.split("=", 1)[1]) or "default"
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    return f"rlcore-{recipe}-{stamp}-{secrets.token_hex(2)}"


def node_local_output(overrides: Sequence[str]) -> Optional[str]:
    """Why the run's storage would be node-local as a Ray Job, or None: a relative `output_dir`
    (`checkpoint.dir`, `checkpoint.export_dir`) resolves inside the job's working dir, which every
    node unpacks for itself under Ray's temp dir (and Ray deletes with it). Composed here, before
    anything is sent; a config this machine cannot compose is left to the job, which reports it
    (and refuses a node-local folder itself: `rlcore.storage.location`)."""
    try:
        from rlcore.config.errors import ConfigError
        from rlcore.plan.compose import compose
    except ImportError:  # a launcher without the run's dependencies: the job checks it
        return None
    try:
        cfg = compose(list(overrides))
    except (ConfigError, Exception):  # noqa: BLE001  Hydra's grammar errors too: the job says them in one line
        return None
    for key, value in (
        ("output_dir", cfg.output_dir),
        ("checkpoint.dir", cfg.checkpoint.dir),
        ("checkpoint.export_dir", cfg.checkpoint.export_dir),
    ):
        if value and "://" not in value and not os.path.isabs(os.path.expanduser(value)):
            return (
                f"{key}={value!r} is relative: a Ray Job runs in each node's own copy of the working dir, "
                "which Ray deletes with its temp dir, so the run's parts would stay on different nodes; "
                f"pass an absolute path on storage every node mounts, e.g. -- {key}=/shared/runs/NAME"
            )
    return None
