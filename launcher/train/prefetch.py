"""Copy host batches to the GPU on a side CUDA stream, `depth` batches ahead of the step that uses them.

    for batch in CudaPrefetcher(host_batches, device, depth=2):
        ...  # every tensor of batch is on `device`, ready for the current stream

A batch is any nesting of tuples, lists and dicts with tensors at the leaves (what a DataLoader's
collate makes); what is not a tensor passes through as it is. Each host tensor is pinned (unless it
already is) so the copy can be asynchronous, then copied with `non_blocking=True` on a side stream while
the compute stream is still busy with earlier steps. `after(batch)`, where given (a recipe's
`on_after_batch_transfer`: decoding, cropping, normalizing on the GPU), runs on that side stream too,
right behind the copy, so it overlaps the compute stream's work as well. Before a batch is handed out,
the compute stream waits for the event recorded after *that batch's* copy (not `wait_stream`, which
would also wait for the copies queued behind it and shrink the overlap), and each device tensor is
marked with `record_stream` so the caching allocator does not hand its memory to a later copy while the
compute stream may still be reading it.

On a CPU device the batches pass through unchanged (`after` still applies).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.utils._pytree import tree_leaves, tree_map

Batch = Any


class CudaPrefetcher:
    def __init__(self, batches: Iterable[Batch], device: torch.device, depth: int = 2,
                 after: Callable[[Batch], Batch] | None = None):
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self.batches = batches
        self.device = torch.device(device)
        self.depth = depth
        self.after = after

    def __iter__(self) -> Iterator[Batch]:
        if self.device.type != "cuda":
            if self.after is None:
                yield from self.batches
            else:
                for batch in self.batches:
                    yield self.after(batch)
            return
        yield from self._prefetch()

    def _prefetch(self) -> Iterator[Batch]:
        copy_stream = torch.cuda.Stream(self.device)
        compute_stream = torch.cuda.current_stream(self.device)
        source = iter(self.batches)
        in_flight: deque[tuple[Batch, torch.cuda.Event]] = deque()

        def issue_next() -> bool:
            try:
                host = next(source)
            except StopIteration:
                return False
            with torch.cuda.stream(copy_stream):
                on_device = to_device(host, self.device)
                if self.after is not None:
                    on_device = self.after(on_device)
                copied = torch.cuda.Event()
                copied.record(copy_stream)
            in_flight.append((on_device, copied))
            return True

        for _ in range(self.depth):
            if not issue_next():
                break
        while in_flight:
            batch, copied = in_flight.popleft()
            compute_stream.wait_event(copied)
            for tensor in tree_leaves(batch):
                if isinstance(tensor, torch.Tensor) and tensor.device.type == "cuda":
                    tensor.record_stream(compute_stream)
            issue_next()
            yield batch


def batch_len(batch: Batch) -> int:
    """Samples in a batch: the leading size of its first tensor (1 when it holds none)."""
    return next((t.shape[0] for t in tree_leaves(batch) if isinstance(t, torch.Tensor) and t.dim() > 0), 1)


def to_device(batch: Batch, device: torch.device) -> Batch:
    """Every tensor of a (nested) batch copied to `device` without blocking the host."""
    return tree_map(lambda t: _to_device(t, device) if isinstance(t, torch.Tensor) else t, batch)


def _to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    if tensor.device == device:
        return tensor
    if not tensor.is_pinned():
        # Pageable memory would make the "non_blocking" copy synchronous. Pinned blocks come from
        # torch's caching host allocator, which keeps each one until the copies reading it are done.
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)
