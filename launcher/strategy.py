"""single / dp / ddp / auto: which strategy runs, on how many processes, and how a model is wrapped for it.

The choice is pure data (`choose`, `Layout`) so it is unit-tested without processes; `wrap_model`
is the one place that touches torch.nn.parallel.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from launcher.config import ConfigError

if TYPE_CHECKING:
    import torch

# Measured through `launch` itself (bench/scaling.py, BENCHMARKS.md run C): 2x H200, torch 2.11,
# 2026-11-22, CIFAR-shaped data, bf16, ResNet-18 at batch 512 per GPU, all in one run.
DP_COST = (
    "strategy=dp runs nn.DataParallel in one process, which is slow: on 2x H200 with ResNet-18 at batch "
    "512/GPU it gave 15.3k img/s (0.26x), against 59.4k on ONE GPU and 115.9k with DDP on two (BENCHMARKS.md). "
    "Use strategy=ddp (the default for several GPUs) unless you need one process."
)


@dataclass(frozen=True)
class Layout:
    """What will run: the resolved strategy, how many worker processes, and the batch each one sees."""

    strategy: str  # single | dp | ddp
    device_type: str  # cuda | cpu
    num_devices: int  # GPUs in use (0 on CPU)
    nprocs: int  # worker processes
    global_batch: int
    dist_backend: str | None  # nccl | gloo | None when there is one process

    @property
    def world_size(self) -> int:
        return self.nprocs

    @property
    def batch_per_process(self) -> int:
        """ddp: each rank's share; dp and single: the whole global batch (DataParallel splits it itself)."""
        return self.global_batch // self.nprocs


def check_batch_splits(global_batch: int, ranks: int) -> None:
    """The global batch must divide evenly over the ranks (each rank takes batch_size / ranks)."""
    if global_batch % ranks:
        low, high = (global_batch // ranks) * ranks, (global_batch // ranks + 1) * ranks
        raise ConfigError("batch_size", global_batch, f"the global batch must split evenly over {ranks} ranks",
                          f"batch_size={low if low > 0 else high}")


def choose(name: str, num_gpus: int, nprocs: int | None, global_batch: int, backend: str = "auto",
           gpus_text: str = "") -> Layout:
    """Resolve `strategy`, `gpus` and `nprocs` into a Layout, or raise ConfigError with the fix.

    auto: ddp when more than one device (GPUs, or CPU ranks via nprocs), else single; never dp.
    """
    on_gpu = num_gpus > 0
    device_type = "cuda" if on_gpu else "cpu"
    shown_gpus = gpus_text or str(num_gpus)
    if on_gpu and nprocs is not None and nprocs != num_gpus:
        raise ConfigError("nprocs", nprocs, f"nprocs sets CPU ranks; on GPUs there is one process per GPU "
                          f"({num_gpus} for gpus={shown_gpus}); drop nprocs, or add gpus=[] for CPU ranks",
                          f"gpus=[] strategy=ddp nprocs={nprocs}")
    if name == "auto":
        devices = num_gpus if on_gpu else (nprocs or 1)
        name = "ddp" if devices > 1 else "single"
    if name == "single":
        if num_gpus > 1:
            raise ConfigError("strategy", "single", f"single uses one device but gpus={shown_gpus} selects "
                              f"{num_gpus}; use strategy=ddp, or pick one GPU", "gpus=[0] strategy=single")
        if not on_gpu and (nprocs or 1) > 1:
            raise ConfigError("strategy", "single", f"single runs one process but nprocs={nprocs}; "
                              "use strategy=ddp for several CPU ranks", "gpus=[] strategy=ddp nprocs=2")
        procs = 1
    elif name == "dp":
        if not on_gpu:
            raise ConfigError("strategy", "dp", "DataParallel needs GPUs and none is selected; on CPU use ddp",
                              "gpus=[] strategy=ddp nprocs=2")
        if nprocs not in (None, 1):
            raise ConfigError("nprocs", nprocs, "strategy=dp runs one process; drop nprocs", "strategy=dp")
        procs = 1
    elif name == "ddp":
        procs = num_gpus if on_gpu else (nprocs or 1)
    else:
        raise ConfigError("strategy", name, "choose one of auto, single, dp, ddp", "strategy=ddp")
    check_batch_splits(global_batch, procs)
    dist_backend = None
    if name == "ddp":
        if backend == "auto":
            dist_backend = "nccl" if on_gpu else "gloo"
        elif backend == "nccl" and not on_gpu:
            raise ConfigError("strategy.backend", backend, "nccl needs GPUs; CPU ranks use gloo",
                              "strategy.backend=gloo")
        else:
            dist_backend = backend
    return Layout(name, device_type, num_gpus, procs, global_batch, dist_backend)


def wrap_model(model: torch.nn.Module, layout: Layout, device: torch.device, options) -> torch.nn.Module:
    """Wrap a model (already on its device) for the strategy. `options` is the `strategy` config node."""
    import torch.nn as nn

    if layout.strategy == "dp":
        return nn.DataParallel(model, device_ids=list(range(layout.num_devices)), output_device=0)
    if layout.strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(
            model,
            device_ids=[device.index] if device.type == "cuda" else None,
            gradient_as_bucket_view=options.gradient_as_bucket_view,
            static_graph=options.static_graph,
            bucket_cap_mb=options.bucket_cap_mb,
            find_unused_parameters=options.find_unused_parameters,
        )
    return model
