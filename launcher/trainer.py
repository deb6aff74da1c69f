"""What each worker process runs: pick its device, join the process group, train, leave cleanly.

The loop itself is launcher/loop.py; batches and their order are launcher/batches.py. Batch semantics,
the same for every strategy: `batch_size` is GLOBAL, the number of samples in one optimizer step summed
over all devices, and one step sees the same images whether it runs on 1 GPU, on 2 with DDP, or on 2
with DataParallel; a run is reproducible from its seed.
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from launcher.distenv import WorldInfo
from launcher.loop import TrainingRun
from launcher.strategy import Layout
from launcher.timeline import StartupTimeline


@dataclass
class WorkerSpec:
    """Everything a worker needs, as plain picklable data (workers never compose Hydra configs)."""

    config: dict[str, Any]  # the resolved config
    run_dir: str
    layout: Layout
    env: dict[str, str]  # applied in the worker before CUDA starts
    resume_from: str | None = None
    started_at: float = 0.0  # the launcher's time.time() when it started, for time-to-first-step
    spawned_s: float | None = None  # seconds after started_at when the launcher started the workers


def pick_device(layout: Layout, world: WorldInfo) -> torch.device:
    if layout.device_type == "cpu":
        return torch.device("cpu")
    # A joined world may give each process a one-GPU mask (srun --gpus-per-task): then it is device 0.
    default = world.local_rank if layout.strategy == "ddp" else 0
    index = int(os.environ.get("LAUNCH_DEVICE_INDEX", default))
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def train(spec: WorkerSpec, world: WorldInfo, timeline: StartupTimeline) -> dict[str, Any] | None:
    """Train one worker's part of the run. Returns the results on rank 0, None elsewhere."""
    cfg = OmegaConf.create(spec.config)
    layout = spec.layout
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():
        # torch may have been imported before the worker env was applied (a joined world): apply it now.
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    device = pick_device(layout, world)
    timeline.mark("device_set")
    if device.type == "cuda":
        # DataParallel runs each replica in a new thread every step, and cuDNN's autotuning results do not
        # carry over between those threads, so with benchmark on it re-tunes every step: on 2x H200 the
        # fast net ran at 2.5k img/s under dp with it on, 63.7k with it off (BENCHMARKS.md).
        torch.backends.cudnn.benchmark = cfg.recipe.cudnn_benchmark and layout.strategy != "dp"
        torch.set_float32_matmul_precision("high")
    distributed = layout.strategy == "ddp"
    if distributed:
        init_process_group(layout.dist_backend, world, timedelta(seconds=cfg.strategy.timeout_s), device)
        timeline.mark("process_group")
    run = TrainingRun(cfg, spec, world, device, timeline)
    # On failure the process group is left alone: destroying an NCCL communicator while peers are
    # still inside a collective blocks forever (seen on 2x H200). The worker exits at once instead.
    try:
        results = run.fit()
    except torch.OutOfMemoryError as exc:
        raise OutOfMemory(_oom_message(cfg, layout, world, device)) from exc
    if distributed:
        # DDP's reducer holds the process group and sits in reference cycles; free it while the
        # interpreter is whole, or gloo's threads may be torn down at exit ("terminate called").
        del run
        gc.collect()
        dist.destroy_process_group()
    return results


class OutOfMemory(RuntimeError):
    """CUDA ran out of memory on a rank: the message says where, at which batch size, and what to lower."""


def _oom_message(cfg, layout: Layout, world: WorldInfo, device: torch.device) -> str:
    rank = world.rank if layout.strategy == "ddp" else 0
    where = "the CPU"
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        peak = torch.cuda.max_memory_allocated(device) / 2**30
        where = (f"GPU {device.index} ({props.name}, {props.total_memory / 2**30:.0f} GiB; this process peaked at "
                 f"{peak:.1f} GiB; CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '')})")
    per_rank = f" = {layout.batch_per_process} per rank" if layout.nprocs > 1 else ""
    lower = max(1, cfg.batch_size // 2)
    lower -= lower % max(1, layout.nprocs) if lower >= layout.nprocs else 0
    return (f"out of memory on rank {rank}, {where}, at batch_size={cfg.batch_size}{per_rank}: lower it "
            f"(e.g. batch_size={lower}), or free the GPU (other jobs on it?); every rank was stopped")


def init_process_group(backend: str, world: WorldInfo, timeout: timedelta, device: torch.device) -> None:
    """init_process_group on a store namespaced by restart attempt.

    Under torchelastic the workers share the agent's TCPStore, which outlives a restart; without a
    per-attempt prefix, restarted ranks can read the dead ranks' addresses and fail to connect
    (pytorch/pytorch#167288). Outside elastic (srun), rank 0 hosts the store itself.
    """
    agent_hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(world.master_addr, world.master_port, world.world_size,
                          is_master=not agent_hosts_store and world.rank == 0, timeout=timeout)
    dist.init_process_group(
        backend=backend, store=dist.PrefixStore(f"launcher/attempt{world.restart_count}", store),
        rank=world.rank, world_size=world.world_size, timeout=timeout,
        device_id=device if device.type == "cuda" else None,
    )
