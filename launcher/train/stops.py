"""Why a run stopped before its end, in one message each: a NaN loss (every rank, at the same epoch) and
running out of GPU memory (where, at which batch, and what to change)."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from launcher.config import Config
from launcher.errors import ExplainedStop
from launcher.files import last_checkpoint
from launcher.train import optim

if TYPE_CHECKING:
    from launcher.strategies import Strategy


class NonFiniteLoss(ExplainedStop):
    """The training loss became NaN or infinite: every rank stops at the end of that epoch."""


class OutOfMemory(ExplainedStop):
    """CUDA ran out of memory on a rank: the message says where, at which batch size, and what to lower."""


def non_finite_loss(cfg: Config, run_dir: Path, epoch: int, loss: float, bad_step: int,
                    steps: int) -> NonFiniteLoss:
    """The training loss became `loss` at global step `bad_step` (from 0) of `epoch`: where, counted from 1 as
    the epoch lines count, and the way on (the last good checkpoint, a lower lr)."""
    last = last_checkpoint(run_dir)
    if epoch > 0 and last.exists() and cfg.saves:
        good = (f"the last good checkpoint is {last} (after epoch {epoch}); resume from it with "
                f"resume={run_dir} and a lower lr (now {cfg.lr})")
    else:
        good = f"no checkpoint precedes it; try a lower lr (now {cfg.lr})"
    return NonFiniteLoss(f"the training loss became {loss} in epoch {epoch + 1} "
                         f"at step {bad_step - epoch * steps + 1} "
                         f"of {steps} (the run's step {bad_step + 1}); training stopped on every rank and "
                         f"epoch {epoch + 1} was not saved; {good}")


def training_state_bytes(params: list[torch.Tensor], state_copies: int) -> tuple[int, int]:
    """(parameters, bytes) this rank holds for training: weights, gradients and `state_copies` optimizer
    tensors of each (its shards under fsdp). Activations and buffers come on top."""
    count = nbytes = 0
    for p in params:
        local = p.to_local() if hasattr(p, "to_local") else p  # (a DTensor: this rank's shard)
        count += p.numel()
        nbytes += local.numel() * local.element_size() * (2 + state_copies)
    return count, nbytes


def oom_message(cfg: Config, strategy: Strategy, device: torch.device, params: list[torch.Tensor] = ()) -> str:
    """One line: where it ran out, and the change most likely to fit: a smaller batch; when the batch
    is one sample a rank, what else; when the weights, gradients and optimizer state alone fill the
    GPU, sharding them (strategy=fsdp)."""
    where, total = "the CPU", 0
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        total = props.total_memory
        peak = torch.cuda.max_memory_allocated(device) / 2**30
        where = (f"GPU {device.index} ({props.name}, {total / 2**30:.0f} GiB; this process peaked at "
                 f"{peak:.1f} GiB; CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '')})")
    ranks = strategy.world_size
    head = f"out of memory on rank {strategy.rank}, {where}"
    count, state = training_state_bytes(list(params), optim.state_per_parameter(cfg.optim))
    if total and state > 0.8 * total:
        held = "its shard of the" if strategy.sharded else "the"
        per_param = state / max(1, count) * (ranks if strategy.sharded else 1)
        if strategy.sharded:
            fix = "more GPUs (fsdp divides them by their number), or a smaller model"
        else:
            needed = max(2, math.ceil(state / (0.6 * total)))
            fix = (f"strategy=fsdp shards them over the GPUs (~{state / needed / 2**30:.0f} GiB each on {needed}: "
                   f"gpus={needed} strategy=fsdp strategy.meta_init=true), or a smaller model")
        return (f"{head}: {held} weights, gradients and {cfg.optim.name} state of the model's "
                f"{count / 1e9:.2f}B parameters ({per_param:.0f} bytes each) need {state / 2**30:.0f} GiB on this "
                f"GPU alone, before any activations; {fix}; every rank was stopped")
    per_rank = f" = {strategy.batch_per_process} per rank" if ranks > 1 else ""
    if strategy.batch_per_process <= 1:
        return (f"{head}, at batch_size={cfg.batch_size}{per_rank}: one sample's activations do not fit beside the "
                f"model's state; shorter inputs, a smaller model, "
                f"perf.activation_checkpointing=selective (or full), or strategy=fsdp; every rank was stopped")
    lower = max(1, cfg.batch_size // 2)
    lower -= lower % ranks if lower >= ranks else 0
    split = (f", or split it as it is (accumulate={cfg.accumulate * 2}: the same batch in smaller steps)"
             if (strategy.batch_per_process // cfg.accumulate) % 2 == 0 else "")
    return (f"{head}, at batch_size={cfg.batch_size}{per_rank}: lower it (e.g. batch_size={lower}){split}, "
            f"or free the GPU (other jobs on it?); every rank was stopped")
