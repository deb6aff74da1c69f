"""From a composed config to a plan: which devices, which strategy, how many workers, and the
environment they start with. Pure apart from counting GPUs (through NVML, never CUDA).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from omegaconf import DictConfig, OmegaConf

from launcher.config import ConfigError
from launcher.distenv import WorldInfo
from launcher.gpus import (
    cuda_visible_devices,
    describe_visible,
    gpu_loads,
    least_busy,
    physical_gpu_count,
    select_gpus,
    visible_devices,
)
from launcher.strategy import Layout, check_batch_splits, choose


@dataclass
class Plan:
    layout: Layout
    gpu_ids: list[int]  # relative to the inherited mask, as the user typed them
    visible: list[str]  # the devices this process could see (tokens of the inherited mask)
    env: dict[str, str] = field(default_factory=dict)  # what every worker starts with
    joined: WorldInfo | None = None  # set when torchrun/srun already started the ranks
    gpu_choice: str | None = None  # gpus=N on a machine with more: which GPUs were chosen and why

    def describe(self, with_batch: bool = True) -> str:
        lay = self.layout
        if lay.device_type == "cpu":
            where = f"CPU, {lay.nprocs} process{'es' if lay.nprocs > 1 else ''}"
        else:
            mask = self.env.get("CUDA_VISIBLE_DEVICES", "")
            where = f"GPU{'s' if len(self.gpu_ids) > 1 else ''} {self.gpu_ids} (CUDA_VISIBLE_DEVICES={mask})"
        batch = f", batch {lay.global_batch} global" if with_batch else ""
        if with_batch and lay.strategy == "ddp" and lay.nprocs > 1:
            batch += f" = {lay.batch_per_process} x {lay.nprocs} ranks"
        backend = f", {lay.dist_backend}" if lay.dist_backend else ""
        joined = ", joining an existing world" if self.joined else ""
        return f"{lay.strategy}{backend} on {where}{batch}{joined}"


def torch_has_cuda() -> bool:
    """Whether this torch was built with CUDA (reads the build, does not start CUDA)."""
    import torch

    return torch.version.cuda is not None


def _gpus_text(spec) -> str:
    value = OmegaConf.to_container(spec) if OmegaConf.is_config(spec) else spec
    return "[" + ",".join(map(str, value)) + "]" if isinstance(value, list) else str(value)


def _thread_env(env: Mapping[str, str], nprocs: int, on_gpu: bool) -> dict[str, str]:
    """CPU threads per worker, unless the user set OMP_NUM_THREADS.

    GPU workers get 1, as under torchrun: their CPU work is issuing kernels, and idle OpenMP threads
    spinning after a parallel region only compete with that (no measurement here isolates the effect;
    BENCHMARKS.md). CPU workers do the arithmetic themselves, so they share the cores instead
    (torchrun's 1 would starve them).
    """
    if "OMP_NUM_THREADS" in env:
        return {}
    return {"OMP_NUM_THREADS": "1" if on_gpu else str(max(1, available_cores(env) // nprocs))}


def available_cores(env: Mapping[str, str]) -> int:
    """Cores this launch may use: a SLURM allocation's share, else this process's CPU affinity.

    os.cpu_count() counts the whole host; two runs sharing it, each sizing its threads to all of it,
    crawled (a 3-run digits job array on the 2-core test cluster: the two runs side by side, 2 threads
    each, at 110 and 116 img/s, the third alone at 11,477; seen once, before this function existed).
    """
    if env.get("SLURM_CPUS_ON_NODE", "").isdigit():  # the job's CPUs on this node, all its tasks together
        return int(env["SLURM_CPUS_ON_NODE"])
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def make_plan(cfg: DictConfig, joined: WorldInfo | None = None, env: Mapping[str, str] | None = None,
              physical_count: int | None = None, loads: list | None = None) -> Plan:
    env = os.environ if env is None else env
    physical = physical_gpu_count() if physical_count is None else physical_count
    visible = visible_devices(env, physical)
    ids = select_gpus(cfg.gpus, visible, env)
    if cfg.gpus == "auto" and cfg.strategy.name == "single":
        ids = ids[:1]  # "all visible" adapts to an explicit one-device strategy
    gpu_choice = None
    count = cfg.gpus if isinstance(cfg.gpus, int) and not isinstance(cfg.gpus, bool) else None
    if joined is None and count is not None and 0 < count < len(visible):
        loads = gpu_loads(visible) if loads is None else loads
        if loads:  # a shared machine: take the least busy GPUs, and say which and why
            ids, gpu_choice = least_busy(loads, count)
    if ids and not torch_has_cuda():
        import torch

        raise ConfigError("gpus", _gpus_text(cfg.gpus), f"this torch ({torch.__version__}) is a CPU build; install a "
                          "CUDA build of torch to use the GPUs, or train on CPU", "gpus=[]")
    if joined is None:
        layout = choose(cfg.strategy.name, len(ids), cfg.nprocs, cfg.batch_size, cfg.strategy.backend,
                        _gpus_text(cfg.gpus))
        worker_env = {"CUDA_VISIBLE_DEVICES": cuda_visible_devices(ids, visible)}
        worker_env.update(_thread_env(env, layout.nprocs, bool(ids)))
        plan = Plan(layout, ids, visible, worker_env, gpu_choice=gpu_choice)
    else:
        plan = _joined_plan(cfg, joined, ids, visible, env)
    if cfg.data.placement == "gpu" and plan.layout.device_type == "cpu":
        raise ConfigError("data.placement", "gpu", "this run trains on the CPU (gpus=[] or no GPU visible); "
                          "use data.placement=auto", "data.placement=auto")
    return plan


def _joined_plan(cfg: DictConfig, world: WorldInfo, ids: list[int], visible: list[str],
                 env: Mapping[str, str]) -> Plan:
    """torchrun or srun started one process per rank already: this process is one of them."""
    name = cfg.strategy.name
    if name == "dp" or (name == "single" and world.world_size > 1):
        raise ConfigError("strategy", name, f"launch runs inside a world of {world.world_size} ranks "
                          "(started by torchrun or srun), which is ddp", "strategy=ddp")
    if cfg.nprocs not in (None, world.world_size):
        raise ConfigError("nprocs", cfg.nprocs, f"torchrun/srun already started {world.world_size} ranks; drop nprocs",
                          "strategy=ddp")
    # The env contract, so the worker reads the same world whether torchrun or SLURM described it.
    worker_env: dict[str, str] = world.as_env()
    if ids:
        # One GPU per local rank: torchrun's convention is cuda:LOCAL_RANK among the visible devices;
        # srun with --gpus-per-task gives each task a mask of its own single GPU.
        if len(ids) >= world.local_world_size:
            mine = ids[world.local_rank]
        elif len(ids) == 1:
            mine = ids[0]
        else:
            raise ConfigError("gpus", _gpus_text(cfg.gpus), f"{world.local_world_size} local ranks need as many "
                              f"GPUs but {describe_visible(visible, env)}", "gpus=auto")
        worker_env["CUDA_VISIBLE_DEVICES"] = visible[mine]
        worker_env["LAUNCH_DEVICE_INDEX"] = "0"
    else:
        worker_env["CUDA_VISIBLE_DEVICES"] = ""
    worker_env.update(_thread_env(env, world.local_world_size, bool(ids)))
    strategy = "ddp" if world.world_size > 1 else "single"
    backend = None
    if strategy == "ddp":
        backend = cfg.strategy.backend if cfg.strategy.backend != "auto" else ("nccl" if ids else "gloo")
    check_batch_splits(cfg.batch_size, world.world_size)
    layout = Layout(strategy, "cuda" if ids else "cpu", 1 if ids else 0, world.world_size, cfg.batch_size, backend)
    return Plan(layout, ids, visible, worker_env, joined=world)
