"""perf.cuda_graph's gradient path on CPU (2 gloo ranks): flat gradients averaged in buckets.

On a CPU device the step is not captured (no graphs there) but runs the same code eagerly, so what
a GPU run replays, the bucketed all-reduce from autograd hooks included, is checked here against
DistributedDataParallel.
"""

import gc
import json
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from launcher.strategies.gradients import FlatGradients

pytestmark = pytest.mark.distributed

DDP_CPU = ("recipe=digits", "gpus=[]", "strategy=ddp", "nprocs=2", "epochs=3")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Flatten(),
                               torch.nn.Linear(8 * 6 * 6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _compare_with_ddp(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    x = torch.randn(6, 3, 8, 8, generator=torch.Generator().manual_seed(rank))  # each rank its own batch
    reference = torch.nn.parallel.DistributedDataParallel(_model())
    reference(x).square().mean().backward()
    ours = _model()
    grads = FlatGradients(ours.parameters(), world_size=world, bucket_mb=0.001)  # ~1 KB: several buckets
    results = {"buckets": len(grads.buckets)}
    for _ in range(2):  # twice: the second backward must reuse the same buffers and re-arm the hooks
        grads.zero()
        grads.start_backward()
        ours(x).square().mean().backward()
        grads.finish_backward()
    results["max_diff"] = max((a.grad - b.grad).abs().max().item()
                              for a, b in zip(reference.module.parameters(), ours.parameters(), strict=True))
    results["views_kept"] = all(p.grad is v for p, v in grads.views.items())
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    # DDP's reducer holds the process group from inside reference cycles: free it while the interpreter
    # is whole, or gloo's threads can be torn down at exit ("terminate called without an active exception").
    del reference, ours, grads
    gc.collect()
    dist.destroy_process_group()


def test_bucketed_flat_all_reduce_gives_ddps_gradients(tmp_path):
    out = tmp_path / "result.json"
    mp.start_processes(_compare_with_ddp, args=(2, _free_port(), str(out)), nprocs=2, start_method="spawn")
    result = json.loads(out.read_text())
    assert result["buckets"] >= 2, result
    assert result["max_diff"] < 1e-6, result
    assert result["views_kept"]


def test_cuda_graph_ddp_run_trains_like_ddp(launch):
    ddp = launch(*DDP_CPU, "hydra.run.dir=with_ddp")
    ours = launch(*DDP_CPU, "perf.cuda_graph=true", "hydra.run.dir=flat")
    assert ddp.returncode == 0, ddp.output
    assert ours.returncode == 0, ours.output
    a, b = (json.loads((run.cwd / name / "results.json").read_text()) for run, name in ((ddp, "with_ddp"),
                                                                                      (ours, "flat")))
    assert a["gradient_sync"] == "DDP" and b["gradient_sync"] == "flat all-reduce"
    assert b["cuda_graph"] is False  # nothing is captured on a CPU device
    assert b["ranks_agree"], b["weights_sha256"]
    losses = [[row["loss"] for row in _rows(run.cwd / name)] for run, name in ((ddp, "with_ddp"), (ours, "flat"))]
    # The same data, the same averaged gradients: training losses agree to float rounding.
    assert losses[0] == pytest.approx(losses[1], rel=1e-4), losses


def _rows(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_captured_ddp_whose_step_cannot_be_tried_wraps_with_ddps_own_reducer():
    """perf.cuda_graph=auto under ddp picks CapturedDDP on the host; a worker that finds a recipe's own
    training_step turns static gradients off, and the model must then get DDP's reducer, not flat
    buckets nobody fills from a graph (and DDP's watchdog, not the graph's bounded wait)."""
    from launcher.config import DDPConfig, PerfConfig, Toggle
    from launcher.strategies import CapturedDDP, Devices, choose

    chosen = choose(DDPConfig(), Devices((0, 1)), nprocs=None, global_batch=8, perf=PerfConfig(), gpus_text="[0,1]")
    strategy = chosen.strategy
    assert type(strategy) is CapturedDDP and strategy.static_gradients and chosen.perf.cuda_graph is Toggle.auto
    assert strategy.gradient_sync == "flat all-reduce" and strategy.collective_timeout() is not None
    strategy.static_gradients = False  # (what the worker does for a recipe's own training_step)
    assert strategy.gradient_sync == "DDP" and strategy.collective_timeout() is None
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        nets = strategy.wrap(_model(), torch.device("cpu"))
        assert isinstance(nets.train, torch.nn.parallel.DistributedDataParallel) and nets.grads is None
        del nets
        gc.collect()
    finally:
        dist.destroy_process_group()
