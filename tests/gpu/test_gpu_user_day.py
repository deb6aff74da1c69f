"""GPU checks for issues 6 and 7 (marked `gpu`, skipped without CUDA): a sweep whose runs share out the
GPUs, a real CUDA out-of-memory, and gpus=N passing over a busy GPU.

    python -m pytest -m gpu tests/gpu/test_gpu_user_day.py -v      # on nvidia-h200-x2
"""

import contextlib
import json
import subprocess
import sys
import time

import pytest

two_gpus = pytest.mark.two_gpus


@contextlib.contextmanager
def another_job_holding(gpu_memory: dict[int, float]):
    """A separate process that holds a share of the free memory of each GPU given, as another user's job would."""
    hold = ("import sys, time, torch; shares = eval(sys.argv[1]); "
            "held = [torch.empty(int(torch.cuda.mem_get_info(i)[0] * share), dtype=torch.uint8, device=f'cuda:{i}') "
            "for i, share in shares.items()]; print('ready', flush=True); time.sleep(600)")
    hog = subprocess.Popen([sys.executable, "-c", hold, repr(gpu_memory)], stdout=subprocess.PIPE, text=True)
    try:
        assert hog.stdout.readline().strip() == "ready"
        time.sleep(1)  # NVML's view catches up
        yield
    finally:
        hog.kill()
        hog.wait()


@two_gpus
def test_a_two_run_sweep_runs_at_once_on_gpu_0_and_gpu_1(launch):
    result = launch("-m", "recipe=cifar10", "data.synthetic=true", "gpus=1", "epochs=3", "seed=0,1", timeout=600)
    assert result.returncode == 0, result.output
    runs = sorted(result.cwd.glob("multirun/*/*/[01]/results.json"))
    results = [json.loads(p.read_text()) for p in runs]
    assert sorted(r["cuda_visible_devices"] for r in results) == ["0", "1"]  # one GPU each, different ones
    # at once: the second run started before the first finished
    assert result.stdout.index("sweep: job 1 started") < result.stdout.index("sweep: job 0 done")


def test_a_sweeps_runs_forked_from_its_run_server_train_on_cuda(launch):
    """A local sweep's runs are forks of one process that imported torch without touching CUDA, and their
    workers forks of the run (launcher/host/packing.py): each still trains on the GPU (every results.json
    says CUDA: tests/gpu/conftest.py)."""
    result = launch("-m", "recipe=cifar10", "data.synthetic=true", "gpus=1", "epochs=2", "seed=0,1", timeout=600)
    assert result.returncode == 0, result.output
    assert len(list(result.cwd.glob("multirun/*/*/[01]/results.json"))) == 2


@two_gpus
def test_a_sweep_run_of_ddp_on_two_gpus_starts_its_workers_by_fork(launch):
    """Each run of the sweep is DDP on both GPUs, its two workers forks of the run (NCCL after the fork)."""
    result = launch("-m", "recipe=cifar10", "data.synthetic=true", "gpus=[0,1]", "epochs=2", "seed=0,1",
                    timeout=600)
    assert result.returncode == 0, result.output
    for path in result.cwd.glob("multirun/*/*/[01]/results.json"):
        assert json.loads(path.read_text())["world_size"] == 2


@two_gpus
def test_cuda_out_of_memory_names_the_rank_the_gpu_and_the_batch(launch):
    # Another job leaves ~10% of each GPU free: ResNet-18's activations for 8,192 images per rank do not fit.
    with another_job_holding({0: 0.9, 1: 0.9}):
        result = launch("recipe=cifar10", "data.synthetic=true", "recipe.model=resnet18", "gpus=[0,1]", "epochs=1",
                        "batch_size=16384", "perf.cuda_graph=false", timeout=600)
    assert result.returncode == 1, result.output
    err = result.stderr
    assert "out of memory on rank" in err and "GPU" in err and "batch_size=16384 = 8192 per rank" in err
    assert "Traceback" not in err


@two_gpus
def test_gpus_1_passes_over_a_busy_gpu(launch):
    with another_job_holding({0: 0.8}):
        result = launch("recipe=cifar10", "data.synthetic=true", "gpus=1", "dry_run=true")
    assert result.returncode == 0, result.output
    assert "chose GPU [1]" in result.stdout and "passed over busy GPU 0" in result.stdout
