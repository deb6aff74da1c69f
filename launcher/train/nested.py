"""The tensors of a nested state (dicts, lists and tuples of tensors, as state_dicts and optimizer states
nest them), with a tensor that two names hold counted, copied and stored once.

A network whose output layer is its embedding (recipe=text's GPT, GPT-2, most language models) has one
parameter under two names, and `state_dict()` gives both names a view of the same memory. torch.save keeps
that (one storage in the file); a copy made tensor by tensor would not, and the checkpoint would hold the
embedding twice (GPT-2 124M: 154 MB of fp32 in every last.pt). So every copy of a state made here maps
each distinct tensor once and gives each of its names the same copy. (fsdp's sharded checkpoints are
torch.distributed.checkpoint's, which writes each name apart; `launch export` ties such a pair again.)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch


def same_memory(t: torch.Tensor) -> tuple:
    """What two names' tensors share when they are one tensor: their memory, and how they read it. Tensors
    without elements or memory (meta) are never one (their storages may all have address 0), nor are those
    whose memory cannot be read so (sparse tensors, a tensor subclass without a storage): each is its own."""
    local = t.to_local() if hasattr(t, "to_local") else t  # (a DTensor, under fsdp: this rank's shard)
    if local.numel() == 0 or local.device.type == "meta" or local.layout is not torch.strided:
        return ("apart", id(t))
    try:
        storage = local.untyped_storage().data_ptr()
    except (NotImplementedError, RuntimeError):
        return ("apart", id(t))
    return (local.device, storage, local.storage_offset(), local.dtype, tuple(local.shape), local.stride())


def tensors_in(obj: Any) -> list[torch.Tensor]:
    """Every distinct tensor of `obj`, in the order a walk meets them (a tensor under two names once)."""
    return list({same_memory(t): t for t in every_tensor(obj)}.values())


def every_tensor(obj: Any) -> Iterator[torch.Tensor]:
    """Each name's tensor of `obj` (a tensor under two names twice)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from every_tensor(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from every_tensor(v)


def mapped(obj: Any, fn: Callable[[torch.Tensor], Any], _done: dict[tuple, Any] | None = None) -> Any:
    """`obj` with each tensor replaced by `fn(tensor)`, called once per distinct tensor: names that held one
    tensor hold one result."""
    done = {} if _done is None else _done  # (the results so far, through the walk's recursion)
    if isinstance(obj, torch.Tensor):
        key = same_memory(obj)
        if key not in done:
            done[key] = fn(obj)
        return done[key]
    if isinstance(obj, dict):
        return {k: mapped(v, fn, done) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(mapped(v, fn, done) for v in obj)
    return obj


def local_nbytes(obj: Any) -> int:
    """The bytes of `obj`'s tensors as this rank holds them (a DTensor: its shard), each name's tensor
    counted: torch.distributed's host copy of a state (fsdp's sharded checkpoints) copies each name apart."""
    locals_ = (t.to_local() if hasattr(t, "to_local") else t for t in every_tensor(obj))
    return sum(t.numel() * t.element_size() for t in locals_)
