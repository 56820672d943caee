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


def pytest_collection_modifyitems(config, items):
    import torch
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (run on the GPU machine)")
    gpu_dir = Path(__file__).resolve().parent / "gpu"
    for item in items:
        # the marker, or a test under tests/gpu/; not `"gpu" in item.keywords`, which also matches
        # a checkout whose own folder is named gpu and skipped its whole suite
        if item.get_closest_marker("gpu") is not None or gpu_dir in Path(str(item.path)).resolve().parents:
            item.add_marker(skip)
