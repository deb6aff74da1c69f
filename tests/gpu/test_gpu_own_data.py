"""GPU checks of a recipe's own Datasets (marked `gpu`, skipped without CUDA): the DataLoader path on CUDA,
with a captured step, dict batches, a mid-epoch resume, and recipe=imagefolder decoding JPEGs on the GPU.

    python -m pytest -m gpu tests/gpu/test_gpu_own_data.py -v
"""

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from tests.imagefolders import write_image_folder

OWN = Path(__file__).parent.parent / "distributed" / "data" / "own"  # (indexed.py)
EXAMPLES = Path(__file__).parents[2] / "examples"  # docs/own-code.md's (regression.py, nets.py)


def _project(cwd: Path) -> None:
    for f in [*OWN.glob("*.py"), *EXAMPLES.glob("*.py")]:
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
        if decode == "auto":  # (too few batches here for the trial to end: it says what it tries)
            assert "data.decode=auto: the first training batches of the second epoch" in result.output


def test_imagefolder_decode_auto_times_the_workers_then_a_split_if_they_fall_behind(launch, tmp_path):
    """Enough batches for data.decode=auto's trial to end: the workers alone, timed by the steps and by what
    they make; a split sized from those times only where the workers needed longer than the steps; one line
    says which was kept and every time, and the run goes on with it."""
    import re

    root = write_image_folder(tmp_path / "imagenet", train_per_class=40, odd_files=False)
    result = launch("recipe=imagefolder", f"data.root={root}", "recipe.model=resnet18", "recipe.image_size=64",
                    "gpus=[0]", "epochs=3", "batch_size=2", "data.workers=1", "data.decode=auto",
                    "perf.compile=false", "eval.every=0", timeout=300)
    assert result.returncode == 0, result.output
    kept = [line for line in result.output.splitlines() if "data.decode=auto: kept " in line]
    assert len(kept) == 1, result.output
    alone = re.search(r"the workers alone [0-9.]+ ms \(steps ([0-9.]+), workers ([0-9.]+), prefetch thread ([0-9.]+)\)",
                      kept[0])
    assert alone, kept[0]
    steps, workers, thread = map(float, alone.groups())
    assert steps > 0.0 and thread > 0.0, kept[0]  # (the steps on the GPU's clock; the thread resized crops)
    assert ("on the GPU" in kept[0]) == (workers > max(steps, thread) * 1.02), kept[0]
    assert json.loads((_run_dir(result) / "results.json").read_text())["device_type"] == "cuda"


def test_the_step_pace_is_each_steps_own_time_on_the_gpus_clock_without_the_wait_for_its_batch():
    """What data.decode=auto times the steps by (launcher/data/pace.py StepPace): 20 ms of GPU work a step
    after the host waited 30 ms for each batch reads as the GPU's 20 ms, not as the 50 ms between batches."""
    import time

    from launcher.data.pace import StepPace
    from launcher.train.stall import StepClock

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 20_000_000
    torch.cuda._sleep(cycles)  # (warm)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    alone_s = start.elapsed_time(end) / 1000
    pace = StepPace()
    clock = StepClock(device, pace=pace)
    clock.start()
    began = time.perf_counter()
    for _ in range(6):
        time.sleep(alone_s + 0.03)  # (the GPU idles: the batch is late)
        clock.batch_ready()
        torch.cuda._sleep(cycles)
        clock.step_end()
    between = (time.perf_counter() - began) / 6
    timing = clock.finish()
    assert pace.median_s(6) == pytest.approx(alone_s, rel=0.2), (pace.median_s(6), alone_s)
    assert between > 1.5 * alone_s and timing.input_wait_s > 6 * 0.02


def by_torch_ops(batch, size: int) -> torch.Tensor:
    """recipe=imagefolder's GPU batch made by the torch ops image_kernels' one kernel replaced (the reference)."""
    from launcher.data import image_kernels
    from launcher.data.gpu_decode import Normalizer, gpu_batch

    usable = image_kernels.usable
    image_kernels.usable = lambda device: False
    try:
        return gpu_batch(batch, size, skip_bad=False, normalize=Normalizer(True))[0]
    finally:
        image_kernels.usable = usable


def test_imagefolders_one_kernel_on_cuda_matches_the_torch_ops_for_each_decoder(tmp_path):
    """The batch's crops, flips and normalization by image_kernels' Triton kernel on CUDA against the torch ops
    it replaced, on the same decoded images; and nvImageCodec's decoder (the batch split between its two
    decoders: 64 JPEGs), where installed, against torchvision's nvJPEG."""
    from launcher.data import gpu_decode
    from launcher.data.folders import scan
    from launcher.data.gpu_decode import Normalizer, gpu_batch
    from launcher.data.images import ImageFolderSplit, collate

    root = write_image_folder(tmp_path / "imagenet", train_per_class=22, odd_files=True)
    device = torch.device("cuda", 0)
    ds = ImageFolderSplit(scan(root)["train"], train=True, image_size=48, eval_resize=55, gpu_share=1.0)
    ds.set_epoch(0)
    pixels, labels, rows, work = collate([ds[i] for i in range(len(ds))])
    assert len(work.jpegs) >= 64 and len(rows) > 0
    batch = (pixels.to(device), labels.to(device), rows.to(device), work)
    outputs = {}
    for decoder in ("hardware", "nvjpeg"):
        gpu_decode._hardware.clear()
        if decoder == "nvjpeg":
            gpu_decode._hardware[device] = None
        elif gpu_decode.hardware_decoder(device) is None:
            continue
        x, y = gpu_batch(batch, 48, skip_bad=False, normalize=Normalizer(True))
        assert x.is_cuda and x.is_contiguous(memory_format=torch.channels_last) and torch.equal(y, batch[1])
        ref = by_torch_ops(batch, 48)
        # (the same arithmetic in another order: within a few thousandths of a unit of the normalized pixels)
        assert float((x - ref).abs().max()) < 0.01, decoder
        outputs[decoder] = x
    gpu_decode._hardware.clear()
    if "hardware" in outputs:  # two JPEG decoders: the same images up to their rounding
        assert float((outputs["hardware"] - outputs["nvjpeg"]).abs().mean()) < 0.05


def test_imagefolders_workers_crops_resized_on_cuda_match_the_cpu_path(tmp_path):
    """data.decode=gpu/auto on CUDA: the workers' crops, decoded but not resized (Regions in one buffer),
    resized by the kernel on the GPU: as the torch ops resize them, and as the CPU path's crops (up to the
    two resizes' rounding); beside JPEGs decoded on the GPU in the same batch."""
    from launcher.data.folders import scan
    from launcher.data.gpu_decode import Normalizer, gpu_batch, resizes_on_gpu
    from launcher.data.images import MEAN, STD, ImageFolderSplit, collate

    assert resizes_on_gpu()
    root = write_image_folder(tmp_path / "imagenet", train_per_class=22, odd_files=True)
    device = torch.device("cuda", 0)
    for train in (True, False):
        common = dict(train=train, image_size=48, eval_resize=55)
        folder = scan(root)["train" if train else "val"]
        cpu = ImageFolderSplit(folder, **common)
        ds = ImageFolderSplit(folder, regions=True, gpu_share=0.5, **common)
        for split in (cpu, ds):
            split.set_epoch(0)
        pixels, labels, rows, work = collate([ds[i] for i in range(len(ds))])
        assert len(work.regions) > 0 and (len(work.jpegs) > 0 or not train)
        batch = (pixels.to(device), labels.to(device), rows.to(device), work)
        x, y = gpu_batch(batch, 48, skip_bad=False, normalize=Normalizer(True))
        assert x.is_cuda and torch.equal(y, batch[1])
        ref = by_torch_ops(batch, 48)
        assert float((x - ref).abs().max()) < 0.01
        back = x.float().cpu() * torch.tensor(STD).view(1, 3, 1, 1) + torch.tensor(MEAN).view(1, 3, 1, 1)
        reference = torch.stack([cpu[i][0] for i in range(len(cpu))]).float()
        diff = (back - reference).abs()[work.regions.rows]  # (the rows the workers decoded)
        assert diff.mean() < 1.5 and diff.mean(dim=(1, 2, 3)).max() < 3.0


@pytest.mark.two_gpus
def test_imagefolder_saved_inside_an_epoch_on_two_gpus_resumes_on_one_in_the_same_order(launch, tmp_path,
                                                                                        tmp_path_factory):
    """The GPU decoding path (data.decode=gpu: JPEGs decoded on each GPU) keeps the global order: a checkpoint
    2 steps into the second epoch on 2 GPUs, resumed on 1, trains the batches an uninterrupted 1-GPU run does."""
    from tests.imagefolders import check_two_ranks_resumed_on_one

    root = write_image_folder(tmp_path_factory.mktemp("imagenet"), train_per_class=12)
    check_two_ranks_resumed_on_one(launch, tmp_path, tmp_path_factory.mktemp("whole"), root,
                                   two=("gpus=[0,1]",), one=("gpus=[0]",),
                                   common=("recipe.model=resnet18", "recipe.image_size=64", "data.workers=2",
                                           "data.decode=gpu"))


SMALL_STEP = '''"""A small network on in-memory tensors, with the launcher's own step (perf.cuda_graph=auto)."""
import torch
from torch import nn
from torch.utils.data import TensorDataset

from launcher.recipes import Recipe


def tensors(n, seed):
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 4, (n,), generator=g)
    return TensorDataset(torch.randn(n, 32, generator=g) + y.view(-1, 1), y)


class SmallStep(Recipe):
    models = ("mlp",)

    def load(self):
        return tensors(4096, 0), tensors(512, 1)

    def num_classes(self, train):
        return 4

    def build_model(self, num_classes):
        return nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(32, 32), nn.GELU())], nn.Linear(32, 4))
'''


def test_cuda_graph_auto_replays_a_small_networks_step_and_says_so(launch, tmp_path):
    """A step of many tiny kernels is paced by the host's launches: auto times both ways and replays it."""
    (tmp_path / "small_step.py").write_text(SMALL_STEP)
    result = launch("recipe=small_step", "gpus=[0]", "epochs=2", "batch_size=64", "optim=adamw", "lr=0.003",
                    "data.workers=1", timeout=300)
    assert result.returncode == 0, result.output
    line = re.search(r"perf\.cuda_graph=auto: the step (replayed as one CUDA graph|runs eagerly) \(([\d.]+) ms a "
                     r"step replayed, ([\d.]+) ms eagerly", result.output)
    assert line, result.output
    assert line.group(1) == "replayed as one CUDA graph" and float(line.group(2)) < float(line.group(3))
    r = json.loads((_run_dir(result) / "results.json").read_text())
    assert r["device_type"] == "cuda" and r["cuda_graph"] is True and r["test_acc"] > 0.9


def test_cuda_graph_auto_leaves_a_recipes_own_training_step_eager(launch, tmp_path):
    """A replay would skip the Python of a recipe's own training_step: auto does not capture it."""
    _project(tmp_path)
    result = launch("recipe=regression", "gpus=[0]", "epochs=2", "batch_size=256", "data.workers=1", timeout=300)
    assert result.returncode == 0, result.output
    assert "perf.cuda_graph" not in result.output
    r = json.loads((_run_dir(result) / "results.json").read_text())
    assert r["device_type"] == "cuda" and r["cuda_graph"] is False
