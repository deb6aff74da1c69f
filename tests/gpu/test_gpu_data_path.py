"""The GPU data paths (marked `gpu`): the side-stream prefetcher, host placement, and the record-speed recipe.

    python -m pytest -m gpu tests/gpu -v
"""

import pytest
import torch

from launcher.data.prefetch import CudaPrefetcher

two_gpus = pytest.mark.two_gpus

FAST = ("recipe=cifar10_fast", "data.synthetic=true")


def _blocking_after(batch):
    """GPU work on the side stream that blocks its thread until done (as a GPU image decoder does)."""
    x, y = batch
    out = (x.float() + 1.0, y * 2.0)
    torch.cuda.current_stream().synchronize()
    return out


@pytest.mark.parametrize("pinned,threaded", [(True, False), (False, False), (True, True)],
                         ids=["pinned-source", "pageable-source", "threaded-blocking-after"])
def test_prefetched_batches_equal_the_source_while_compute_is_busy(pinned, threaded):
    device = torch.device("cuda", 0)
    g = torch.Generator().manual_seed(0)
    source = [(torch.randint(0, 256, (512, 3, 32, 32), dtype=torch.uint8, generator=g),
               torch.randn(512, 17, generator=g)) for _ in range(60)]
    if pinned:
        source = [(x.pin_memory(), y.pin_memory()) for x, y in source]
    if threaded:
        expected = [(x.float() + 1.0, y * 2.0) for x, y in source]
    else:
        expected = source
    busy = torch.randn(4096, 4096, device=device)
    copies = []
    for x, y in CudaPrefetcher(iter(source), device, depth=3, after=_blocking_after if threaded else None,
                               threaded=threaded):
        assert x.is_cuda and y.is_cuda
        for _ in range(3):  # keep the compute stream well behind the copies
            busy = torch.tanh(busy @ busy * 1e-4)
        # Read the batch on the compute stream (as a model would), after the copies queued behind it.
        copies.append((x.clone(), y * 1.0))
        del x, y  # the allocator may reuse their memory: record_stream must keep it until the reads ran
    torch.cuda.synchronize()
    assert len(copies) == len(source)
    for (x, y), (hx, hy) in zip(copies, expected, strict=True):
        assert torch.equal(x.cpu(), hx) and torch.equal(y.cpu(), hy)


def test_host_placement_streams_through_the_prefetcher(launch):
    result = launch("recipe=cifar10", "data.synthetic=true", "epochs=2", "gpus=[0]", "data.placement=host",
                    timeout=600)
    assert result.returncode == 0, result.output
    r = result.results()
    assert r["data_placement"] == "host" and 0 <= r["input_stall"] < 1
    assert "pinned host memory" in result.output


def test_fast_recipe_on_one_gpu(launch):
    result = launch(*FAST, "gpus=[0]", timeout=600)
    assert result.returncode == 0, result.output
    r = result.results()
    assert r["compiled"] and r["data_placement"] == "gpu" and r["epochs"] == 8 and r["batch_size"] == 2000
    assert r["cudnn_benchmark"] is True  # compiled from the start: autotuned from the start (perf.cudnn_benchmark=auto)
    assert r["timed"]["clock"] == "cuda events" and 0 < r["timed"]["train_eval_s"] < 10
    assert r["test_acc"] > 0.9  # the synthetic set is easy: this checks that it learns, not CIFAR-10 accuracy


@two_gpus
def test_fast_recipe_on_two_gpus_with_ddp(launch):
    result = launch(*FAST, "gpus=[0,1]", timeout=600)
    assert result.returncode == 0, result.output
    r = result.results()
    assert r["strategy"] == "ddp" and r["world_size"] == 2 and r["batch_per_process"] == 1000
    assert r["ranks_agree"] and r["test_acc"] > 0.9 and r["compiled"]


@two_gpus
def test_fast_recipe_with_dataparallel(launch):
    result = launch(*FAST, "gpus=[0,1]", "strategy=dp", "epochs=2", timeout=600)
    assert result.returncode == 0, result.output
    r = result.results()
    assert r["strategy"] == "dp" and len(r["devices"]) == 2 and not r["compiled"]
    assert "perf.compile / perf.cuda_graph are off under strategy=dp" in result.output


def test_a_device_named_without_its_index_feeds_from_the_thread():
    """CudaPrefetcher(device="cuda", threaded=True): the thread sets the current device, which needs an index
    (torch refuses a bare "cuda" there); the prefetcher names the current one."""
    source = [(torch.arange(8, dtype=torch.float32) + i,) for i in range(5)]
    got = [x.clone() for (x,) in CudaPrefetcher(iter(source), "cuda", depth=2, after=lambda b: b, threaded=True)]
    torch.cuda.synchronize()
    assert all(g.is_cuda for g in got) and [float(g[0]) for g in got] == [0.0, 1.0, 2.0, 3.0, 4.0]
