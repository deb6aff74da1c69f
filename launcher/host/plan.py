"""From a checked config to a plan: which devices, which strategy, how many workers, and the
environment they start with. Pure apart from counting GPUs (through NVML, never CUDA).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from launcher import strategies
from launcher.config import Config, Placement, Toggle, derive, split_endpoint
from launcher.errors import ConfigError
from launcher.host.gpus import (
    GpuRequest,
    Kind,
    cuda_visible_devices,
    describe_visible,
    gpu_loads,
    least_busy,
    physical_gpu_count,
    visible_devices,
)
from launcher.host.network import NodeNetwork, node_network
from launcher.strategies import Devices, Strategy
from launcher.world import WorldInfo, available_cores


@dataclass(frozen=True)
class Plan:
    strategy: Strategy  # chosen once here; it travels to every worker
    config: Config  # what runs: the user's config with the perf settings the strategy can honour
    gpu_ids: list[int]  # relative to the inherited mask, as the user typed them
    visible: list[str]  # the devices this process could see (tokens of the inherited mask)
    env: dict[str, str] = field(default_factory=dict)  # what every worker starts with
    device_index: int | None = None  # the worker's GPU among those it sees; None: its local rank
    joined: WorldInfo | None = None  # set when torchrun/srun already started the ranks
    gpu_choice: str | None = None  # gpus=N on a machine with more: which GPUs were chosen and why
    notes: tuple[str, ...] = ()  # what the strategy turned off, and its caution (printed before the run)
    network: NodeNetwork | None = None  # nodes > 1: where this node meets the others (launcher/host/network.py)

    def describe(self, with_batch: bool = True) -> str:
        s = self.strategy
        if not s.devices.on_gpu:
            where = f"CPU, {s.processes} process{'es' if s.processes > 1 else ''}"
        else:
            mask = self.env.get("CUDA_VISIBLE_DEVICES", "")
            where = f"GPU{'s' if len(self.gpu_ids) > 1 else ''} {self.gpu_ids} (CUDA_VISIBLE_DEVICES={mask})"
        backend = f", {s.process_group_backend}" if s.process_group_backend else ""
        batch = f", batch {s.global_batch} global" if with_batch else ""
        if with_batch and s.world_size > 1:
            batch += f" = {s.batch_per_process} x {s.world_size} ranks"
        if with_batch and s.accumulate > 1:
            batch += f", each in {s.accumulate} micro-batches of {s.batch_per_process // s.accumulate}"
        joined = ", joining an existing world" if self.joined else ""
        if self.network is not None:
            cfg = self.config
            node = f"node {cfg.node_rank}" if cfg.node_rank is not None else "a node (its rank given at the rendezvous)"
            joined += f"; {node} of {cfg.nodes}, {s.processes} rank{'s' if s.processes > 1 else ''} each, " \
                      f"{self.network.describe()}"
        return f"{s.name}{backend} on {where}{batch}{joined}"

    def record(self) -> dict:
        """What plan.json holds."""
        nodes = None
        if self.network is not None:
            nodes = {"nodes": self.config.nodes, "node_rank": self.config.node_rank, "rdzv": self.config.rdzv,
                     **dataclasses.asdict(self.network)}
        return {**self.strategy.facts(), "gpu_ids": self.gpu_ids, "visible_devices": self.visible,
                "worker_env": self.env, "joined": self.joined.as_env() if self.joined else None, "nodes": nodes}


def torch_has_cuda() -> bool:
    """Whether this torch was built with CUDA (reads the build, does not start CUDA)."""
    import torch

    return torch.version.cuda is not None


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


def make_plan(cfg: Config, joined: WorldInfo | None = None, env: Mapping[str, str] | None = None,
              physical_count: int | None = None, loads: list | None = None) -> Plan:
    """Devices, strategy and worker environment for `cfg` on this host, or a ConfigError saying what to change."""
    env = os.environ if env is None else env
    physical = physical_gpu_count() if physical_count is None else physical_count
    visible = visible_devices(env, physical)
    request = GpuRequest.parse(cfg.gpus)
    ids = request.select(visible, env, one_device=strategies.one_device(cfg.strategy))
    gpu_choice = None
    if joined is None and request.kind is Kind.COUNT and request.count < len(visible):
        loads = gpu_loads(visible) if loads is None else loads
        if loads:  # a shared machine: take the least busy GPUs, and say which and why
            ids, gpu_choice = least_busy(loads, request.count)
    if ids and not torch_has_cuda():
        import torch

        raise ConfigError("gpus", request.text, f"this torch ({torch.__version__}) is a CPU build; install a "
                          "CUDA build of torch to use the GPUs, or train on CPU", "gpus=[]")
    if cfg.data.placement is Placement.gpu and not ids:
        raise ConfigError("data.placement", "gpu", "this run trains on the CPU (gpus=[] or no GPU visible); "
                          "use data.placement=auto", "data.placement=auto")
    if joined is not None:
        if cfg.nodes > 1:
            raise ConfigError("nodes", cfg.nodes, f"launch runs inside a world torchrun or srun started "
                              f"({joined.world_size} ranks), which already spans its nodes: drop nodes, node_rank "
                              "and rdzv", "strategy=ddp")
        return _joined_plan(cfg, joined, request, ids, visible, env)
    choice = strategies.choose(cfg.strategy, Devices(tuple(ids)), nprocs=cfg.nprocs, global_batch=cfg.batch_size,
                               perf=cfg.perf, gpus_text=request.text, accumulate=cfg.accumulate, nodes=cfg.nodes)
    worker_env = {"CUDA_VISIBLE_DEVICES": cuda_visible_devices(ids, visible)}
    worker_env.update(_thread_env(env, choice.strategy.processes, bool(ids)))
    net = None
    if cfg.nodes > 1:
        net = node_network(*split_endpoint(cfg.rdzv), cfg.node_rank)
        worker_env.update(interface_env(env, net.interface))
    else:
        worker_env.update(loopback_env(env))
    notes = _notes(choice)
    if choice.strategy.name == "fsdp" and choice.strategy.world_size == 1:  # (nothing to shard over)
        more = "nprocs=2 (CPU ranks)" if not ids else "gpus=2"
        notes = (*notes, f"strategy=fsdp on one process shards nothing: its one rank holds the whole model (give "
                 f"{more} to shard it)")
    if cfg.perf.cuda_graph is Toggle.true and not ids:  # (asked for: said, not dropped in silence)
        notes = (*notes, "perf.cuda_graph=true: CUDA graphs replay steps on GPUs; this run on the CPU runs its "
                 "steps uncaptured (results.json: cuda_graph false)")
    return Plan(choice.strategy, derive(cfg, perf=choice.perf), ids, visible, worker_env, gpu_choice=gpu_choice,
                notes=notes, network=net)


def loopback_env(env: Mapping[str, str]) -> dict[str, str]:
    """A single-machine launch's workers talk over loopback only: gloo's and NCCL's sockets bind `lo`
    (the rendezvous store is bound to 127.0.0.1 too, see rendezvous.py). A value the user set stays."""
    return interface_env(env, "lo")


def interface_env(env: Mapping[str, str], interface: str) -> dict[str, str]:
    """gloo's and NCCL's sockets on `interface` (NCCL's `=` means that name exactly, not a prefix), unless
    the user set them. Several nodes: the interface that leads to the rendezvous (launcher/host/network.py)."""
    wanted = {"GLOO_SOCKET_IFNAME": interface, "NCCL_SOCKET_IFNAME": f"={interface}"}
    return {k: v for k, v in wanted.items() if k not in env}


def _notes(choice: strategies.Chosen) -> tuple[str, ...]:
    return tuple(n for n in (choice.note, choice.strategy.warning()) if n)


def _joined_plan(cfg: Config, world: WorldInfo, request: GpuRequest, ids: list[int], visible: list[str],
                 env: Mapping[str, str]) -> Plan:
    """torchrun or srun started one process per rank already: this process is one of them."""
    if cfg.nprocs not in (None, world.world_size):
        raise ConfigError("nprocs", cfg.nprocs, f"torchrun/srun already started {world.world_size} ranks; drop "
                          "nprocs", "strategy=ddp")
    # The env contract, so the worker reads the same world whether torchrun or SLURM described it.
    worker_env: dict[str, str] = world.as_env()
    device_index = None
    mine: tuple[int, ...] = ()
    if ids:
        # One GPU per local rank: torchrun's convention is cuda:LOCAL_RANK among the visible devices;
        # srun with --gpus-per-task gives each task a mask of its own single GPU.
        if len(ids) >= world.local_world_size:
            mine = (ids[world.local_rank],)
        elif len(ids) == 1:
            mine = (ids[0],)
        else:
            raise ConfigError("gpus", request.text, f"{world.local_world_size} local ranks need as many GPUs but "
                              f"{describe_visible(visible, env)}", "gpus=auto")
        worker_env["CUDA_VISIBLE_DEVICES"] = visible[mine[0]]
        device_index = 0
    else:
        worker_env["CUDA_VISIBLE_DEVICES"] = ""
    worker_env.update(_thread_env(env, world.local_world_size, bool(ids)))
    choice = strategies.for_world(cfg.strategy, world, Devices(mine), global_batch=cfg.batch_size, perf=cfg.perf,
                                  accumulate=cfg.accumulate)
    return Plan(choice.strategy, derive(cfg, perf=choice.perf), ids, visible, worker_env, device_index,
                joined=world, notes=_notes(choice))
