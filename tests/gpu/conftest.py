"""GPU tests: run on the device machine (`python -m pytest -m gpu tests/gpu -v`), skipped without CUDA.

Every test in this folder is marked `gpu` and skipped where torch sees no CUDA device; tests marked
`two_gpus` also need a second GPU, and those marked `four_gpus` four.
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
        elif item.get_closest_marker("four_gpus") and count < 4:
            item.add_marker(pytest.mark.skip(reason="needs 4 GPUs"))


@pytest.fixture(autouse=True)
def every_run_ran_on_cuda(tmp_path):
    """A silent fall-back to the CPU must fail a GPU test: every run a test finished in its directory
    (results.json, eval.json) says it ran on CUDA."""
    yield
    import json

    for name in ("results.json", "eval.json"):
        for path in tmp_path.glob(f"**/{name}"):
            ran_on = json.loads(path.read_text()).get("device_type")
            assert ran_on == "cuda", f"{path} ran on {ran_on}, not CUDA"
