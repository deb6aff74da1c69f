"""GPU checks of a recipe's own Datasets (marked `gpu`, skipped without CUDA): the DataLoader path on CUDA,
with a captured step, dict batches, a mid-epoch resume, and recipe=imagefolder decoding JPEGs on the GPU.

    python -m pytest -m gpu tests/gpu/test_gpu_own_data.py -v
"""

import json
import re
import shutil
from pathlib import Path

import torch

from tests.imagefolders import write_image_folder

OWN = Path(__file__).parent.parent / "distributed" / "data" / "own"


def _project(cwd: Path) -> None:
    for f in OWN.glob("*.py"):
        shutil.copy(f, cwd / f.name)


def _run_dir(result) -> Path:
    return Path(re.search(r"run dir: (\S+)", result.output).group(1))


def test_a_regression_dataset_trains_on_cuda_captured_and_its_rmse_falls(launch, tmp_path):
    _project(tmp_path)
    result = launch("recipe=regression", "gpus=[0]", "epochs=4", "batch_size=256", "optim=adamw", "lr=0.01",
                    "perf.cuda_graph=true", "data.workers=2", timeout=300)
    assert result.returncode == 0, result.output
    r = json.loads((_run_dir(result) / "results.json").read_text())
    assert r["device_type"] == "cuda" and r["cuda_graph"] is True
    rows = [json.loads(x) for x in (_run_dir(result) / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["test_rmse"] < rows[0]["test_rmse"]


def test_dict_batches_resume_inside_an_epoch_on_cuda(launch, tmp_path):
    _project(tmp_path)
    first = launch("recipe=indexed", "gpus=[0]", "epochs=2", "batch_size=8", "checkpoint_every_steps=5",
                   "fault.rank=0", "fault.step=17", "data.workers=1", timeout=300)
    assert first.returncode == 1
    state = torch.load(_run_dir(first) / "checkpoints" / "last.pt", weights_only=True)
    assert (state["epoch"], state["step_in_epoch"]) == (1, 5)
    resumed = launch("recipe=indexed", f"resume={_run_dir(first)}", "gpus=[0]", "data.workers=1", timeout=300)
    assert resumed.returncode == 0, resumed.output
    assert "resuming epoch 2 at step 6 of 12" in resumed.output


def test_imagefolder_decodes_jpegs_on_the_gpu_and_trains(launch, tmp_path):
    root = write_image_folder(tmp_path / "imagenet")
    for decode in ("gpu", "auto", "cpu"):
        result = launch("recipe=imagefolder", f"data.root={root}", "recipe.model=resnet18", "recipe.image_size=64",
                        "gpus=[0]", "epochs=2", "batch_size=8", "data.workers=2", f"data.decode={decode}", timeout=300)
        assert result.returncode == 0, result.output
        r = json.loads((_run_dir(result) / "results.json").read_text())
        assert r["device_type"] == "cuda" and 0.0 <= r["test_acc"] <= 1.0
        assert "no CUDA device" not in result.output
