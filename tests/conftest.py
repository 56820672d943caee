import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from actors.session import local_ray_environment  # noqa: E402

local_ray_environment()


@pytest.fixture
def tiny_cfg(tmp_path):
    """The embedded default config, composed exactly as the CLI does (in a fresh output_dir)."""
    from rlcore.plan.compose import compose

    return compose([f"output_dir={tmp_path / 'run'}"])


@pytest.fixture
def capped_disk(tmp_path):
    """`capped_disk(size)`: a folder on a tmpfs of `size` (e.g. "64k"): writes past it fail with
    ENOSPC, a real full disk. Needs root (mount); skipped with the reason where it cannot mount."""
    import subprocess
    import uuid

    mounted = []

    def make(size: str) -> Path:
        mnt = tmp_path / f"disk-{uuid.uuid4().hex[:6]}"
        mnt.mkdir()
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)], capture_output=True, text=True
        )
        if done.returncode != 0:
            pytest.skip(f"cannot mount a size-capped tmpfs here ({done.stderr.strip() or done.returncode}): needs root")
        mounted.append(mnt)
        return mnt

    yield make
    for mnt in mounted:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def fill_disk(folder: Path) -> Path:
    """Write a file into `folder` until its filesystem is full; returns the file (delete it to
    free the space)."""
    filler = folder / "filler"
    try:
        with open(filler, "wb") as fh:
            while True:
                fh.write(b"\0" * 65536)
    except OSError:
        pass
    try:  # the last partial block: byte by byte to the very end
        with open(filler, "ab", buffering=0) as fh:
            while True:
                fh.write(b"\0")
    except OSError:
        pass
    return filler


TEST_PROCESSES = int(os.environ.get("RLCORE_TEST_PROCESSES", "2"))
"""Test processes when `-n` does not say (pytest-xdist): two, each test file whole in one.
`RLCORE_TEST_PROCESSES=1 uv run pytest -q` runs one. On a 2-core box a fresh clone's suite took
43-46 min in one process and 31.2 min in two (2026-12-07, d94dbb6, 1432 passed). Of the four
two-process runs before it, two failed, and each failure was fixed at its cause: a memory bound a
worker forked from a fragmented heap did not hold, a worker stop with no deadline (both faults of
the code, which the serial order never showed) and a test that timed a call's start."""


def pytest_configure(config):
    """With `RLCORE_TEST_PROCESSES` > 1: that many processes, each test file whole in one of them
    (a module's cluster fixture starts once), the longest files first, unless `-n` says otherwise,
    output is not captured (`-s`: its prints would be lost in a worker), a debugger is asked for,
    or xdist is not installed (the GPU machine's stage). Runs before xdist's own
    `pytest_configure` (trylast), which starts the workers."""
    opt = config.option
    if TEST_PROCESSES <= 1 or not config.pluginmanager.hasplugin("xdist") or hasattr(config, "workerinput"):
        return
    if opt.numprocesses is not None or getattr(opt, "dist", "no") != "no" or getattr(opt, "tx", None):
        return
    if opt.capture == "no" or opt.usepdb or opt.collectonly:
        return
    opt.numprocesses, opt.dist, opt.tx = TEST_PROCESSES, "loadfile", ["popen"] * TEST_PROCESSES
    opt.loadscopereorder = False  # files in collection order (LONGEST_FILES first), not by test count


LONGEST_FILES = (
    "test_multinode.py",
    "test_storage_object_store.py",
    "test_slurm.py",
    "test_smollm2.py",
    "test_lifecycle_integration.py",
    "test_chaos.py",
    "test_ray_jobs.py",
    "test_trainer_heal.py",
    "test_pd_integration.py",
    "test_moe_families.py",
    "test_trainer_perf.py",
    "test_integration.py",
)
"""The files that took longest (2026-12-07: 557 s to 71 s each, one process), run first in an
xdist worker: the many short files then fill the end, instead of one long file starting last.
Order only; a file missing here runs after them in its usual place. One process keeps the usual order."""


def pytest_collection_modifyitems(config, items):
    import torch

    if hasattr(config, "workerinput"):  # an xdist worker: the order the controller hands files out
        rank = {name: i for i, name in enumerate(LONGEST_FILES)}
        items.sort(key=lambda item: rank.get(Path(str(item.path)).name, len(rank)))  # stable: a file's order kept
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (run on the GPU machine)")
    gpu_dir = Path(__file__).resolve().parent / "gpu"
    for item in items:
        # the marker, or a test under tests/gpu/; not `"gpu" in item.keywords`, which also matches
        # a checkout whose own folder is named gpu and skipped its whole suite
        if item.get_closest_marker("gpu") is not None or gpu_dir in Path(str(item.path)).resolve().parents:
            item.add_marker(skip)
