"""Copy host batches to the GPU on a side CUDA stream, `depth` batches ahead of the step that uses them.

    for x, y in CudaPrefetcher(host_batches, device, depth=2):
        ...  # x, y are on `device`, ready for the current stream

Each host tensor is pinned (unless it already is) so the copy can be asynchronous, then copied with
`non_blocking=True` on a side stream while the compute stream is still busy with earlier steps. Before
a batch is handed out, the compute stream waits for the event recorded after *that batch's* copy (not
`wait_stream`, which would also wait for the copies queued behind it and shrink the overlap), and each
device tensor is marked with `record_stream` so the caching allocator does not hand its memory to a
later copy while the compute stream may still be reading it.

On a CPU device the batches pass through unchanged.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator

import torch

Batch = tuple[torch.Tensor, ...]


class CudaPrefetcher:
    def __init__(self, batches: Iterable[Batch], device: torch.device, depth: int = 2):
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self.batches = batches
        self.device = torch.device(device)
        self.depth = depth

    def __iter__(self) -> Iterator[Batch]:
        if self.device.type != "cuda":
            yield from self.batches
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
                on_device = tuple(_to_device(t, self.device) for t in host)
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
            for tensor in batch:
                tensor.record_stream(compute_stream)
            issue_next()
            yield batch


def _to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    if not tensor.is_pinned():
        # Pageable memory would make the "non_blocking" copy synchronous. Pinned blocks come from
        # torch's caching host allocator, which keeps each one until the copies reading it are done.
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)
