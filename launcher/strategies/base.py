"""The Strategy base class: how the devices of a run share its work, for the host and for each worker.

A strategy is chosen once, by the launcher's plan (launcher/strategies/__init__.py `choose`), from the
`strategy` config, the devices and the batch. The same object then travels to every worker in its
WorkerSpec. It carries

- host-side facts: how many worker processes to start, the world size, the process-group backend,
  the batch each process takes, what a SLURM job must ask for, a line describing it;
- worker behaviour: which device a rank uses, joining the process group, wrapping the model (and
  the model to evaluate), reductions across ranks, averaging buffers, gathering facts from every rank,
  the model's state dict, leaving cleanly.

The training loop asks the strategy; it never compares strategy names. This module never imports
torch at import time (the launcher reads the host-side facts without it); worker-side methods import
it when they run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from launcher.config import PerfConfig, StrategyConfig
from launcher.errors import ConfigError

if TYPE_CHECKING:
    import torch

    from launcher.strategies.gradients import FlatGradients
    from launcher.world import WorldInfo


@dataclass(frozen=True)
class Devices:
    """The devices one host gives a run: GPU ids (relative to the inherited mask, as the user typed
    them), or none for the CPU."""

    gpu_ids: tuple[int, ...] = ()

    @property
    def on_gpu(self) -> bool:
        return bool(self.gpu_ids)

    @property
    def count(self) -> int:
        return len(self.gpu_ids)

    @property
    def type(self) -> str:
        """torch's device type: cuda or cpu."""
        return "cuda" if self.gpu_ids else "cpu"


@dataclass
class Nets:
    """A model as a strategy prepared it: the bare module (weights, state dict), what the training step
    calls, what evaluation calls, and the gradients' flat buffers when the step is captured."""

    module: Any  # torch.nn.Module
    train: Any
    eval: Any
    grads: FlatGradients | None = None


def check_batch_splits(global_batch: int, ranks: int, accumulate: int = 1) -> None:
    """The global batch must divide evenly over the ranks (each rank takes batch_size / ranks), and each
    rank's share into `accumulate` micro-batches."""
    if global_batch % ranks:
        low, high = (global_batch // ranks) * ranks, (global_batch // ranks + 1) * ranks
        raise ConfigError("batch_size", global_batch, f"the global batch must split evenly over {ranks} ranks",
                          f"batch_size={low if low > 0 else high}")
    if (global_batch // ranks) % accumulate:
        parts = ranks * accumulate
        fits = max(parts, global_batch // parts * parts)
        raise ConfigError("accumulate", accumulate, f"each rank's {global_batch // ranks} samples of batch_size="
                          f"{global_batch} must split evenly into {accumulate} micro-batches",
                          f"batch_size={fits} accumulate={accumulate}")


class Strategy:
    """One process on one device. Subclasses change what differs; see the module docstring."""

    name: ClassVar[str]  # as the plan and results.json show it
    one_device: ClassVar[bool] = False  # `gpus=auto` then means the first visible GPU, not all of them
    distributed: ClassVar[bool] = False  # ranks in a process group
    multi_node: ClassVar[bool] = False  # may span several nodes (nodes > 1, or backend.nodes on SLURM)
    joins_worlds: ClassVar[bool] = True  # can run as the ranks of a world torchrun or srun started
    runs_scripts: ClassVar[bool] = True  # script= runs one process per device under it
    sharded: ClassVar[bool] = False  # each rank holds part of the state: every rank writes its checkpoint shards
    overlaps_epoch_ends: ClassVar[bool] = True  # an epoch's end may be read while the next epoch runs
    lockstep_eval: ClassVar[bool] = False  # every rank's forward is a collective: equal evaluation chunk counts

    def __init__(self, options: StrategyConfig, devices: Devices, processes: int, global_batch: int,
                 world_size: int | None = None, static_gradients: bool = False, accumulate: int = 1):
        self.options = options
        self.devices = devices
        self.processes = processes  # worker processes on this host
        self.world_size = world_size or processes  # ranks in all (several nodes: processes x nodes)
        self.global_batch = global_batch
        self.static_gradients = static_gradients  # perf.cuda_graph: gradients in flat buffers that stay put
        self.accumulate = accumulate  # micro-batches per step (gradient accumulation)
        check_batch_splits(global_batch, self.world_size, accumulate)
        self.rank = 0  # set in the worker by setup()

    # ---- choosing (host) --------------------------------------------------------------------------
    @classmethod
    def processes_for(cls, options: StrategyConfig, devices: Devices, nprocs: int | None, gpus_text: str) -> int:
        """How many processes this strategy runs on `devices`, or a ConfigError saying what to change."""
        if devices.count > 1:
            raise ConfigError("strategy", cls.name, f"{cls.name} uses one device but gpus={gpus_text} selects "
                              f"{devices.count}; use strategy=ddp, or pick one GPU", "gpus=[0] strategy=single")
        if not devices.on_gpu and (nprocs or 1) > 1:
            raise ConfigError("strategy", cls.name, f"{cls.name} runs one process but nprocs={nprocs}; use "
                              "strategy=ddp for several CPU ranks", "gpus=[] strategy=ddp nprocs=2")
        return 1

    @classmethod
    def adjust_perf(cls, perf: PerfConfig) -> tuple[PerfConfig, str | None]:
        """The perf settings this strategy can honour, and a line saying what it turned off (or None)."""
        return perf, None

    # ---- host-side facts --------------------------------------------------------------------------
    @property
    def process_group_backend(self) -> str | None:
        return None

    @property
    def batch_per_process(self) -> int:
        """What one process feeds each step: its share under ddp, the whole batch otherwise."""
        return self.global_batch // self.world_size

    @property
    def gradient_sync(self) -> str | None:
        """How gradients are averaged across ranks (results.json), None with one rank."""
        return None

    def warning(self) -> str | None:
        """A caution to print before the run starts (e.g. DataParallel's cost)."""
        return None

    def fit_memory(self, spare_bytes: int | None, parameters: int) -> str | None:
        """Told before the workers start (launcher/host/memory.py) what a rank's device has left beside the
        run's estimated state and activations (None: not estimated) for a model of `parameters`: a strategy
        with memory to trade for speed decides it here, for its workers, and says its choice in a line."""
        return None

    @property
    def layout(self) -> str | None:
        """How `wrap` laid the model out over the ranks, in one line (fsdp's units), once it has run: the
        worker logs it and results.json keeps it as `sharding`. None where there is nothing to say."""
        return None

    def facts(self) -> dict[str, Any]:
        """What plan.json records of the strategy."""
        return {"strategy": self.name, "device_type": self.devices.type, "nprocs": self.processes,
                "world_size": self.world_size, "global_batch": self.global_batch,
                "batch_per_process": self.batch_per_process, "accumulate": self.accumulate,
                "micro_batch": self.batch_per_process // self.accumulate, "dist_backend": self.process_group_backend,
                "gradient_sync": self.gradient_sync}

    # ---- worker behaviour -------------------------------------------------------------------------
    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def device_index(self, world: WorldInfo) -> int:
        """This rank's GPU among those visible to its process, unless the plan named one."""
        return 0

    def select_device(self, world: WorldInfo, index: int | None) -> torch.device:
        import torch

        if not self.devices.on_gpu:
            return torch.device("cpu")
        index = self.device_index(world) if index is None else index
        torch.cuda.set_device(index)
        return torch.device("cuda", index)

    def setup(self, world: WorldInfo, device: torch.device) -> None:
        """Join whatever the ranks share (a process group). One process: nothing to join."""
        self.rank = 0

    def build_model(self, build: Callable[[], torch.nn.Module], device: torch.device) -> torch.nn.Module:
        """The recipe's model (`build()`) where this strategy wants it before `wrap`: on the device."""
        return build().to(device)

    def wrap(self, model: torch.nn.Module, device: torch.device) -> Nets:
        """The model (already on its device) as training and evaluation use it."""
        grads = None
        if self.static_gradients:
            from launcher.strategies.gradients import FlatGradients

            grads = FlatGradients(model.parameters(), 1, bucket_mb(getattr(self.options, "bucket_cap_mb", 0), model))
        return Nets(model, model, model, grads)

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Sum (or max) `tensor` over the ranks, in place; returns it."""
        return tensor

    def compile(self, nets: Nets, compiled: Callable[[Callable], Callable]) -> Nets:
        """The nets with `compiled` applied (perf.compile: the trainer hands in torch.compile with the run's
        mode and caches, launcher/train/compiling.py). Here the training net is compiled whole: under ddp,
        compiling the DDP module lets dynamo split the graph at gradient buckets so the all-reduce still
        overlaps the backward pass; evaluation compiles the bare model."""
        train_net = compiled(nets.train)
        eval_net = train_net if nets.eval is nets.train else compiled(nets.eval)
        return Nets(nets.module, train_net, eval_net, nets.grads)

    def no_sync(self, nets: Nets) -> contextlib.AbstractContextManager:
        """A backward pass inside leaves the gradients unsynchronized (a micro-batch before the last)."""
        return contextlib.nullcontext()

    def prepare_reduce_host(self) -> None:
        """Set up what `reduce_host` needs, at a point every rank reaches together (the first step)."""

    def reduce_host(self, values: list[float], op: str = "sum") -> list[float]:
        """Sum (or max) host numbers over the ranks, without touching the device's stream (the epoch's
        figures are read while the next epoch's steps run: launcher/train/loop.py)."""
        return list(values)

    def align(self, device: torch.device) -> None:
        """Wait until every rank has arrived (each epoch's clock starts then)."""

    def barrier(self) -> None:
        """Nobody leaves before everyone got here (outside the device's stream)."""

    def average_buffers(self, model: torch.nn.Module) -> None:
        """Make the ranks' buffers (BatchNorm statistics) equal at the end of an epoch."""

    def gather(self, obj: Any) -> list[Any]:
        """`obj` from every rank, in rank order."""
        return [obj]

    def collective_timeout(self) -> float | None:
        """How long the host may wait for the device's epoch before a peer counts as stuck: set when
        collectives run inside a CUDA graph, where no NCCL watchdog sees them; None otherwise."""
        return None

    def memory_devices(self, device: torch.device) -> list[int]:
        """The GPUs whose peak memory this rank reports."""
        return [device.index] if device.type == "cuda" else []

    def device_names(self, device: torch.device) -> list[str]:
        import torch

        return [torch.cuda.get_device_name(i) for i in self.memory_devices(device)]

    def state_dict(self, nets: Nets) -> dict[str, Any]:
        """The model's weights and buffers as a checkpoint stores them (no wrapper prefixes)."""
        return nets.module.state_dict()

    def load_state_dict(self, nets: Nets, state: dict[str, Any]) -> None:
        nets.module.load_state_dict(state)

    def weights_digest(self, nets: Nets) -> str:
        """SHA-256 of the weights this rank holds (results.json shows every rank's: they must agree)."""
        return weights_sha256(self.state_dict(nets))

    def teardown(self) -> None:
        """Leave what setup() joined, after a run that ended well."""


def bucket_mb(chosen: int, model: torch.nn.Module) -> int:
    """The gradient buckets' size in MB: `chosen` (strategy.bucket_cap_mb), or where that is 0, a fifth of
    the model's gradients, no less than torch's 25 and no more than 100. Small models keep torch's
    default; GPT-2 124M (498 MB of fp32 gradients) gets 100: on 2x H200 the nanoGPT-style script ran faster
    with 100 MB buckets than with 25, and no faster with 300 (measured: BENCHMARKS.md section 5).
    Why was not measured apart (fewer buckets are fewer pieces where dynamo splits a compiled model, and
    fewer all-reduces); the cap keeps the last bucket, which nothing overlaps, at most 100 MB."""
    if chosen:
        return chosen
    grad_mb = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad) / 2**20
    return int(min(100, max(25, round(grad_mb / 5))))


def weights_sha256(state: dict[str, Any]) -> str:
    """SHA-256 of a state dict's names and values (every tensor as float64 or int64 on the CPU): the weights
    digest results.json shows for every rank (they must agree)."""
    import hashlib

    import torch

    h = hashlib.sha256()
    for name, tensor in state.items():
        h.update(name.encode())
        h.update(tensor.detach().to("cpu", torch.float64 if tensor.is_floating_point() else torch.int64)
                 .contiguous().numpy().tobytes())
    return h.hexdigest()
