"""GPU tests: collected everywhere, run only where CUDA is present (``@pytest.mark.gpu(gpus=N)``).

Checking for CUDA here must not create a CUDA context in the pytest process: the tests spawn their
GPU processes with their own ``CUDA_VISIBLE_DEVICES``.
"""

from __future__ import annotations

import pytest


def _gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001 - a broken CUDA install is "no GPU" for collection
        return 0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpus = None
    for item in items:
        if item.get_closest_marker("gpu") is None:
            continue
        if gpus is None:
            gpus = _gpu_count()
        need = item.get_closest_marker("gpu").kwargs.get("gpus", 1)
        if gpus < need:
            item.add_marker(pytest.mark.skip(reason=f"needs {need} CUDA GPU(s), found {gpus}"))
