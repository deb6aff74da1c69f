"""Strategy choice: auto never picks dp, combinations that cannot work fail with the fix."""

import pytest

from launcher.config import ConfigError
from launcher.strategy import choose


@pytest.mark.parametrize("name, gpus, nprocs, expect, procs, backend", [
    ("auto", 0, None, "single", 1, None),
    ("auto", 1, None, "single", 1, None),
    ("auto", 2, None, "ddp", 2, "nccl"),
    ("auto", 8, None, "ddp", 8, "nccl"),
    ("auto", 0, 2, "ddp", 2, "gloo"),
    ("single", 1, None, "single", 1, None),
    ("dp", 2, None, "dp", 1, None),
    ("ddp", 2, None, "ddp", 2, "nccl"),
    ("ddp", 0, 2, "ddp", 2, "gloo"),
    ("ddp", 0, None, "ddp", 1, "gloo"),
])
def test_choice(name, gpus, nprocs, expect, procs, backend):
    layout = choose(name, gpus, nprocs, global_batch=64)
    assert (layout.strategy, layout.nprocs, layout.dist_backend) == (expect, procs, backend)


def test_global_batch_is_split_only_by_ddp():
    assert choose("ddp", 2, None, 512).batch_per_process == 256
    assert choose("dp", 2, None, 512).batch_per_process == 512  # DataParallel splits it inside the step
    assert choose("single", 1, None, 512).batch_per_process == 512


@pytest.mark.parametrize("name, gpus, nprocs, batch, words", [
    ("dp", 0, None, 64, "DataParallel needs GPUs"),
    ("single", 2, None, 64, "single uses one device"),
    ("single", 0, 2, 64, "single runs one process"),
    ("ddp", 2, 3, 64, "nprocs sets CPU ranks"),
    ("ddp", 0, 3, 64, "split evenly over 3 ranks"),
    ("dp", 2, 2, 64, "runs one process"),
    ("magic", 1, None, 64, "choose one of"),
])
def test_bad_combinations(name, gpus, nprocs, batch, words):
    with pytest.raises(ConfigError, match=words):
        choose(name, gpus, nprocs, batch)


def test_nccl_on_cpu_is_refused():
    with pytest.raises(ConfigError, match="nccl needs GPUs"):
        choose("ddp", 0, 2, 64, backend="nccl")


def test_batch_suggestion_is_divisible():
    with pytest.raises(ConfigError, match=r"batch_size=62"):
        choose("ddp", 0, 2, 63)
