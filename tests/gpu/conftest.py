"""GPU tests: run on the device machine (`python -m pytest -m gpu tests/gpu -v`), skipped without CUDA.

Every test in this folder is marked `gpu` and skipped where torch sees no CUDA device; tests marked
`two_gpus` also need a second GPU.
"""

from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent


def pytest_collection_modifyitems(config, items):
    cuda = torch.cuda.is_available()
    count = torch.cuda.device_count() if cuda else 0
    for item in items:
        if HERE not in Path(str(item.fspath)).parents:
            continue
        item.add_marker(pytest.mark.gpu)
        if not cuda:
            item.add_marker(pytest.mark.skip(reason="needs CUDA"))
        elif item.get_closest_marker("two_gpus") and count < 2:
            item.add_marker(pytest.mark.skip(reason="needs 2 GPUs"))
