"""strategy=dp: torch.nn.DataParallel, one process driving every selected GPU.

Kept for people who need one process; it is slow. Each step DataParallel scatters the batch,
replicates the model onto every GPU and gathers the outputs on the first, from one Python thread per
GPU, so the host is the bottleneck and torch.compile, CUDA graphs and cuDNN's autotuning cannot help.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from launcher.config import PerfConfig, StrategyConfig, Toggle, derive
from launcher.errors import ConfigError
from launcher.strategies.base import Devices, Nets, Strategy

if TYPE_CHECKING:
    import torch

# Measured through `launch` itself (bench/scaling.py, BENCHMARKS.md run C): 2x H200, torch 2.11,
# 2026-11-22, CIFAR-shaped data, bf16, ResNet-18 at batch 512 per GPU, all in one run.
DP_COST = (
    "strategy=dp runs nn.DataParallel in one process, which is slow: on 2x H200 with ResNet-18 at batch "
    "512/GPU it gave 15.3k img/s (0.26x), against 59.4k on ONE GPU and 115.9k with DDP on two (BENCHMARKS.md). "
    "Use strategy=ddp (the default for several GPUs) unless you need one process."
)


class DataParallel(Strategy):
    name = "dp"
    runs_scripts = False  # a script wraps its own model, one process per device
    joins_worlds = False

    @classmethod
    def processes_for(cls, options: StrategyConfig, devices: Devices, nprocs: int | None, gpus_text: str) -> int:
        if not devices.on_gpu:
            raise ConfigError("strategy", "dp", "DataParallel needs GPUs and none is selected; on CPU use ddp",
                              "gpus=[] strategy=ddp nprocs=2")
        if nprocs not in (None, 1):
            raise ConfigError("nprocs", nprocs, "strategy=dp runs one process; drop nprocs", "strategy=dp")
        return 1

    @classmethod
    def adjust_perf(cls, perf: PerfConfig) -> tuple[PerfConfig, str | None]:
        # DataParallel re-replicates the model every step, which neither a compiled graph nor a captured
        # step survives; and it runs each replica in a new thread every step, where cuDNN's autotuning
        # results do not carry over, so with benchmark on it re-tunes every step (on 2x H200 the fast
        # net ran many times slower under dp with it on than with it off; measured: BENCHMARKS.md section 3).
        note = None
        if perf.compile is Toggle.true or perf.cuda_graph is not Toggle.false:
            note = ("perf.compile / perf.cuda_graph are off under strategy=dp (DataParallel re-replicates the "
                    "model every step); ddp uses them")
        off = Toggle.false
        return derive(perf, compile=off, cuda_graph=off, cudnn_benchmark=off), note

    def warning(self) -> str | None:
        return DP_COST

    def wrap(self, model: torch.nn.Module, device: torch.device) -> Nets:
        from torch import nn

        parallel = nn.DataParallel(model, device_ids=list(range(self.devices.count)), output_device=0)
        return Nets(model, parallel, parallel)  # evaluation, too, spreads the test set over the GPUs

    def memory_devices(self, device: torch.device) -> list[int]:
        return list(range(self.devices.count))
