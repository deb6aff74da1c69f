"""strategy=ddp: one process per GPU (or `nprocs` CPU ranks), gradients averaged across the ranks.

Two ways of averaging, one chosen by the plan:

- DDP: torch's DistributedDataParallel and its reducer (per-parameter autograd hooks, bucketed
  all-reduce overlapping the backward pass).
- CapturedDDP (perf.cuda_graph=true): the step is captured as one CUDA graph and replayed
  (launcher/strategies/gradients.py). DDP's reducer keeps host-side state a replay would skip, so the gradients
  live in flat buffers (FlatGradients) whose buckets are all-reduced from autograd hooks; captured
  once, those all-reduces replay with the backward pass. On a CPU device the same code runs eagerly.
"""

from __future__ import annotations

import contextlib
import os
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from launcher.config import DDPConfig, ProcessGroupBackend, StrategyConfig
from launcher.errors import ConfigError
from launcher.strategies.base import Devices, Nets, Strategy, bucket_mb

if TYPE_CHECKING:
    import torch

    from launcher.world import WorldInfo


class DDP(Strategy):
    name = "ddp"
    distributed = True
    multi_node = True
    options: DDPConfig

    @classmethod
    def processes_for(cls, options: StrategyConfig, devices: Devices, nprocs: int | None, gpus_text: str) -> int:
        if isinstance(options, DDPConfig) and options.backend is ProcessGroupBackend.nccl and not devices.on_gpu:
            raise ConfigError("strategy.backend", "nccl", "nccl needs GPUs; CPU ranks use gloo",
                              "strategy.backend=gloo")
        return devices.count if devices.on_gpu else (nprocs or 1)

    @property
    def process_group_backend(self) -> str:
        chosen = self.options.backend
        if chosen is ProcessGroupBackend.auto:
            return "nccl" if self.devices.on_gpu else "gloo"
        return chosen.value

    @property
    def gradient_sync(self) -> str:
        return "DDP"

    def device_index(self, world: WorldInfo) -> int:
        return world.local_rank

    def setup(self, world: WorldInfo, device: torch.device) -> None:
        """init_process_group on a store namespaced by restart attempt.

        Under torchelastic the workers share the agent's TCPStore, which outlives a restart; without a
        per-attempt prefix, restarted ranks can read the dead ranks' addresses and fail to connect
        (pytorch/pytorch#167288). Outside elastic (srun), rank 0 hosts the store itself.
        """
        import torch.distributed as dist

        timeout = timedelta(seconds=self.options.timeout_s)
        agent_hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        store = dist.TCPStore(world.master_addr, world.master_port, world.world_size,
                              is_master=not agent_hosts_store and world.rank == 0, timeout=timeout)
        dist.init_process_group(
            backend=self.process_group_backend, store=dist.PrefixStore(f"launcher/attempt{world.restart_count}", store),
            rank=world.rank, world_size=world.world_size, timeout=timeout,
            device_id=device if device.type == "cuda" else None,
        )
        self.rank = world.rank
        self._host_group = None  # for reduce_host beside NCCL

    def wrap(self, model: torch.nn.Module, device: torch.device) -> Nets:
        from torch.nn.parallel import DistributedDataParallel

        o = self.options
        ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                      gradient_as_bucket_view=o.gradient_as_bucket_view, static_graph=o.static_graph,
                                      bucket_cap_mb=bucket_mb(o.bucket_cap_mb, model),
                                      find_unused_parameters=o.find_unused_parameters)
        return Nets(model, ddp, model)  # every rank holds the same weights: evaluate the bare module

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        import torch.distributed as dist

        dist.all_reduce(tensor, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
        return tensor

    def no_sync(self, nets: Nets) -> contextlib.AbstractContextManager:
        """DDP's own no_sync (on the DDP module under a compiled wrapper)."""
        ddp = getattr(nets.train, "_orig_mod", nets.train)
        return ddp.no_sync() if hasattr(ddp, "no_sync") else contextlib.nullcontext()

    def prepare_reduce_host(self) -> None:
        """Beside NCCL, a gloo group of the same ranks (a collective of its own: every rank calls this at
        the same point, after the first step)."""
        import torch.distributed as dist

        if self.process_group_backend != "gloo" and self._host_group is None:
            self._host_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=self.options.timeout_s))

    def reduce_host(self, values: list[float], op: str = "sum") -> list[float]:
        """Over gloo (the default group on CPU ranks, the group `prepare_reduce_host` made beside NCCL),
        so the host reads the epoch's figures while its GPU still runs queued work."""
        import torch
        import torch.distributed as dist

        self.prepare_reduce_host()
        tensor = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=self._host_group)
        return tensor.tolist()

    def align(self, device: torch.device) -> None:
        import torch

        self.all_reduce(torch.zeros((), device=device))

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier()

    def average_buffers(self, model: torch.nn.Module) -> None:
        """BatchNorm running stats drift apart across ranks (each sees its own batches): average them,
        in one all-reduce per dtype rather than one per buffer (ResNet-18 has 40)."""
        import torch

        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for buf in model.buffers():
            if buf.is_floating_point():
                by_dtype.setdefault(buf.dtype, []).append(buf)
        for bufs in by_dtype.values():
            flat = self.all_reduce(torch.cat([b.reshape(-1) for b in bufs]))
            flat.div_(self.world_size)
            # copy_ in place: a captured step holds these buffers by address
            for buf, averaged in zip(bufs, flat.split([b.numel() for b in bufs]), strict=True):
                buf.copy_(averaged.view(buf.shape))

    def gather(self, obj: Any) -> list[Any]:
        import torch.distributed as dist

        everyone: list[Any] = [None] * self.world_size
        dist.all_gather_object(everyone, obj)
        return everyone

    def teardown(self) -> None:
        # DDP's reducer holds the process group and sits in reference cycles: the trainer's caller has
        # freed it already (loop.train: heap.release's full collection, just before), while
        # the interpreter is whole, or gloo's threads may be torn down at exit ("terminate called"). On
        # failure nothing is torn down: destroying an NCCL communicator while peers are still inside a
        # collective blocks forever (seen on 2x H200); the worker exits at once instead.
        import torch.distributed as dist

        dist.destroy_process_group()


class CapturedDDP(DDP):
    """DDP for a captured step: gradients in flat buckets, all-reduced from autograd hooks.

    Under perf.cuda_graph=auto the worker may find the step cannot be tried (a recipe's own training_step:
    a replay runs none of its Python) and turn `static_gradients` off before wrapping: the model then goes
    to DDP's own reducer, as under perf.cuda_graph=false."""

    @property
    def gradient_sync(self) -> str:
        return "flat all-reduce" if self.static_gradients else super().gradient_sync

    def wrap(self, model: torch.nn.Module, device: torch.device) -> Nets:
        import torch.distributed as dist

        from launcher.strategies.gradients import FlatGradients

        if not self.static_gradients:
            return super().wrap(model, device)

        for tensor in model.state_dict().values():  # every rank starts from rank 0's weights, as DDP does
            dist.broadcast(tensor, src=0)
        grads = FlatGradients(model.parameters(), self.world_size, bucket_mb(self.options.bucket_cap_mb, model))
        return Nets(model, model, model, grads)

    def collective_timeout(self) -> float | None:
        return float(self.options.timeout_s) if self.static_gradients else None
