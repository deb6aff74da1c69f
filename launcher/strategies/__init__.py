"""How the devices of a run share its work: one class per strategy, chosen once by the launcher's plan.

    single      Single        one process, one device
    dp          DataParallel  one process driving every selected GPU (slow; kept for one-process needs)
    ddp         DDP           one process per GPU or CPU rank, DistributedDataParallel
                CapturedDDP   ddp with perf.cuda_graph: the step replayed as a CUDA graph, own all-reduce
    fsdp        FSDP          one process per GPU or CPU rank, FSDP2: weights, gradients, optimizer sharded
    auto                      ddp for several devices (or nodes), else single (never dp)

The plan calls `choose` (or `for_world` inside a world torchrun or srun started) and puts the strategy
into every WorkerSpec; the training loop then asks it (launcher/strategies/base.py lists what it
answers) and never compares names.

To add a strategy: a class here (a subclass of Strategy: its host-side facts and worker behaviour),
its schema in launcher/config.py (and its line in SCHEMAS), conf/strategy/<name>.yaml, and its entry
in STRATEGIES below.
"""

from __future__ import annotations

from dataclasses import dataclass

from launcher.config import (
    AutoStrategyConfig,
    DataParallelConfig,
    DDPConfig,
    FSDPConfig,
    PerfConfig,
    SingleConfig,
    StrategyConfig,
    Toggle,
    derive,
)
from launcher.errors import ConfigError
from launcher.strategies.base import Devices, Nets, Strategy, check_batch_splits
from launcher.strategies.ddp import DDP, CapturedDDP
from launcher.strategies.dp import DataParallel
from launcher.strategies.fsdp import FSDP
from launcher.strategies.single import Single
from launcher.world import WorldInfo

__all__ = ["Chosen", "Devices", "Nets", "Strategy", "Single", "DataParallel", "DDP", "CapturedDDP", "FSDP", "choose",
           "for_world", "one_device", "check_batch_splits"]

# The strategy each schema selects (auto picks between them).
STRATEGIES: dict[type[StrategyConfig], type[Strategy]] = {
    SingleConfig: Single,
    DataParallelConfig: DataParallel,
    DDPConfig: DDP,
    FSDPConfig: FSDP,
}


@dataclass(frozen=True)
class Chosen:
    """What `choose` gives the plan: the strategy, the perf settings it can honour, and what it turned off."""

    strategy: Strategy
    perf: PerfConfig
    note: str | None = None


def _requested(options: StrategyConfig) -> type[Strategy] | None:
    """The class the user named, or None for auto."""
    if isinstance(options, AutoStrategyConfig):
        return None
    return STRATEGIES[type(options)]


def one_device(options: StrategyConfig) -> bool:
    """Whether `gpus=auto` means one GPU (the first) rather than every visible one."""
    requested = _requested(options)
    return requested is not None and requested.one_device


def _accumulating(perf: PerfConfig, accumulate: int, note: str | None) -> tuple[PerfConfig, str | None]:
    """A captured step holds one micro-batch's work: gradient accumulation runs the step eagerly."""
    if accumulate > 1 and perf.cuda_graph is not Toggle.false:
        said = f"perf.cuda_graph is off with accumulate={accumulate} (a captured step is one micro-batch's work)"
        return derive(perf, cuda_graph=Toggle.false), "; ".join(n for n in (note, said) if n)
    return perf, note


def _fp16(perf: PerfConfig, note: str | None) -> tuple[PerfConfig, str | None]:
    """fp16's gradient scaler decides on the host, after each step, whether the step overflowed: the
    step runs eagerly."""
    if str(perf.precision) == "fp16" and perf.cuda_graph is not Toggle.false:
        said = "perf.cuda_graph is off with perf.precision=fp16 (the gradient scaler steps outside a graph)"
        return derive(perf, cuda_graph=Toggle.false), "; ".join(n for n in (note, said) if n)
    return perf, note


def _auto_graph(cls: type[Strategy], perf: PerfConfig, on_gpu: bool, accumulate: int,
                options: StrategyConfig | None = None, one_node: bool = True) -> PerfConfig:
    """perf.cuda_graph=auto stays auto (the worker times the step both ways and keeps the faster, every
    rank alike) only where a captured step is plain to try: GPUs, one process each (strategy single or
    ddp), one micro-batch a step, no fp16 scaler, not fp8 (its capture not tried), no compile mode that
    makes CUDA graphs itself. Elsewhere it is off, without a word (perf.cuda_graph=true asks for it, and is
    told where it cannot be had).
    Under ddp the trial's two ways both average the gradients in flat buckets (CapturedDDP): DDP's
    reducer runs host code each step that a replay would skip. Both ways all-reduce a compiled step's
    gradients after its backward pass, where DDP's reducer, its graph split at the buckets, overlaps them
    with it: cheap over one machine's NVLink (GPT-2 124M's 0.5 GB of gradients; measured: BENCHMARKS.md
    section 5), not over a network. So several nodes keep DDP's reducer, as does a ddp run that sets its
    options (strategy.find_unused_parameters, strategy.static_graph)."""
    if perf.cuda_graph is not Toggle.auto:
        return derive(perf)
    graphs_itself = perf.compile is not Toggle.false and perf.compile_makes_graphs
    reducer_asked = isinstance(options, DDPConfig) and (options.find_unused_parameters or options.static_graph)
    tried = (cls in (Single, DDP) and on_gpu and accumulate == 1 and str(perf.precision) not in ("fp16", "fp8")
             and not graphs_itself and not (cls is DDP and (reducer_asked or not one_node)))
    return derive(perf, cuda_graph=Toggle.auto if tried else Toggle.false)


def _captured(cls: type[Strategy], perf: PerfConfig) -> tuple[type[Strategy], bool]:
    """perf.cuda_graph (true, or auto where it is tried) needs gradients that stay in place: DDP then
    averages them itself."""
    if perf.cuda_graph is not Toggle.false and cls is DDP:
        return CapturedDDP, True
    return cls, perf.cuda_graph is not Toggle.false


def choose(options: StrategyConfig, devices: Devices, *, nprocs: int | None, global_batch: int, perf: PerfConfig,
           gpus_text: str, nodes: int = 1, accumulate: int = 1, nodes_key: str = "nodes") -> Chosen:
    """The strategy for `devices` on each of `nodes` hosts, or a ConfigError that says what to change."""
    if devices.on_gpu and nprocs is not None and nprocs != devices.count:
        raise ConfigError("nprocs", nprocs, f"nprocs sets CPU ranks; on GPUs there is one process per GPU "
                          f"({devices.count} for gpus={gpus_text}); drop nprocs, or add gpus=[] for CPU ranks",
                          f"gpus=[] strategy=ddp nprocs={nprocs}")
    cls = _requested(options)
    if cls is None:  # auto
        ranks = devices.count if devices.on_gpu else (nprocs or 1)
        cls = DDP if ranks * nodes > 1 else Single
    processes = cls.processes_for(options, devices, nprocs, gpus_text)
    if nodes > 1 and not cls.multi_node:
        raise ConfigError(nodes_key, nodes, f"strategy={cls.name} runs one process; several nodes need ddp or fsdp",
                          f"strategy=ddp {nodes_key}={nodes}")
    if cls.sharded and str(perf.precision) == "fp16":
        raise ConfigError("perf.precision", "fp16", f"strategy={cls.name} shards its own mixed precision (bf16 "
                          "compute, fp32 gradient reduction: strategy.mixed_precision); fp16's gradient scaler is "
                          "for the other strategies", f"strategy={cls.name} perf.precision=auto")
    perf = _auto_graph(cls, perf, devices.on_gpu, accumulate, options, one_node=nodes == 1)
    perf, note = cls.adjust_perf(perf)
    perf, note = _accumulating(perf, accumulate, note)
    perf, note = _fp16(perf, note)
    cls, static = _captured(cls, perf)
    strategy = cls(options, devices, processes, global_batch, world_size=processes * nodes, static_gradients=static,
                   accumulate=accumulate)
    return Chosen(strategy, perf, note)


def for_world(options: StrategyConfig, world: WorldInfo, devices: Devices, *, global_batch: int,
              perf: PerfConfig, accumulate: int = 1) -> Chosen:
    """Inside a world that torchrun or srun started: this process is one of its ranks."""
    requested = _requested(options)
    if requested is not None and (not requested.joins_worlds or (not requested.distributed and world.world_size > 1)):
        raise ConfigError("strategy", requested.name, f"launch runs inside a world of {world.world_size} ranks "
                          "(started by torchrun or srun), which is ddp", "strategy=ddp")
    cls: type[Strategy] = DDP if world.world_size > 1 else Single
    if requested is not None and requested.distributed:  # (fsdp: sharded over the world's ranks)
        cls = requested
    perf = _auto_graph(cls, perf, devices.on_gpu, accumulate, options,
                       one_node=world.world_size == world.local_world_size)
    perf, note = cls.adjust_perf(perf)
    perf, note = _accumulating(perf, accumulate, note)
    perf, note = _fp16(perf, note)
    cls, static = _captured(cls, perf)
    strategy = cls(options, devices, world.local_world_size, global_batch, world_size=world.world_size,
                   static_gradients=static, accumulate=accumulate)
    return Chosen(strategy, perf, note)

