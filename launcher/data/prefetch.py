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

With `threaded=True` the copies and `after` are issued by a thread of their own, `depth` batches ahead:
the training loop's thread never waits for them. That matters when `after` blocks its thread (a GPU
image decoder that returns only once its images are decoded): in the loop's thread the GPU would idle
meanwhile, and a step would cost the decode plus the training (with ResNet-50 on an H100 the two
together ran far slower than either alone; measured: BENCHMARKS.md section 12). The thread's batches
come out in order; an exception raised there (a bad file, the recipe's own error) is raised in the loop's
thread with its traceback; leaving the loop early stops the thread and waits for it, so the next epoch
can use the same DataLoader.

On a CPU device the batches pass through unchanged (`after` still applies, in the thread when threaded).
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.utils._pytree import tree_leaves, tree_map

Batch = Any


class CudaPrefetcher:
    def __init__(self, batches: Iterable[Batch], device: torch.device, depth: int = 2,
                 after: Callable[[Batch], Batch] | None = None, threaded: bool = False):
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self.batches = batches
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:  # ("cuda": the current one, named, so the
            self.device = torch.device("cuda", torch.cuda.current_device())  # thread's set_device can take it)
        self.depth = depth
        self.after = after
        self.threaded = threaded

    def __iter__(self) -> Iterator[Batch]:
        if self.threaded:
            yield from self._threaded()
            return
        if self.device.type != "cuda":
            if self.after is None:
                yield from self.batches
            else:
                for batch in self.batches:
                    yield self.after(batch)
            return
        yield from self._prefetch()

    def _issue(self, host: Batch, copy_stream: torch.cuda.Stream | None) -> tuple[Batch, torch.cuda.Event | None]:
        """One batch copied (on `copy_stream`, a CUDA device) and `after` applied; the event its copy and
        `after` recorded (None on the CPU)."""
        if copy_stream is None:
            return (self.after(host) if self.after is not None else host), None
        with torch.cuda.stream(copy_stream):
            on_device = to_device(host, self.device)
            if self.after is not None:
                on_device = self.after(on_device)
            copied = torch.cuda.Event()
            copied.record(copy_stream)
        return on_device, copied

    @staticmethod
    def _hand_over(batch: Batch, copied: torch.cuda.Event | None, compute_stream: torch.cuda.Stream | None) -> Batch:
        """The compute stream waits for this batch's copy; its tensors are marked as used there."""
        if copied is not None:
            compute_stream.wait_event(copied)
            for tensor in tree_leaves(batch):
                if isinstance(tensor, torch.Tensor) and tensor.device.type == "cuda":
                    tensor.record_stream(compute_stream)
        return batch

    def _threaded(self) -> Iterator[Batch]:
        cuda = self.device.type == "cuda"
        copy_stream = torch.cuda.Stream(self.device) if cuda else None
        compute_stream = torch.cuda.current_stream(self.device) if cuda else None
        ready: queue.Queue = queue.Queue(maxsize=self.depth)
        stop = threading.Event()

        def put(item: Any) -> bool:
            while not stop.is_set():
                try:
                    ready.put(item, timeout=0.05)
                    return True
                except queue.Full:
                    continue
            return False

        def produce() -> None:
            try:
                if cuda:
                    torch.cuda.set_device(self.device)
                for host in self.batches:
                    if not put(self._issue(host, copy_stream)):
                        return
            except BaseException as exc:  # noqa: BLE001 - handed to the loop's thread, raised there
                put((_Failed(exc), None))
                return
            put((_END, None))

        thread = threading.Thread(target=produce, name="launch-prefetch", daemon=True)
        thread.start()
        finished = False
        try:
            while True:
                batch, copied = ready.get()
                if batch is _END:
                    finished = True
                    return
                if isinstance(batch, _Failed):
                    raise batch.exc
                try:
                    yield self._hand_over(batch, copied, compute_stream)
                except GeneratorExit:  # the loop left early: the next epoch may use the same DataLoader
                    finished = True
                    raise
        finally:
            stop.set()
            # On the way out of a failed or interrupted run (Ctrl-C), the thread may be waiting on a
            # DataLoader worker that is gone too: it is a daemon, so waiting a little is enough.
            thread.join(None if finished else 5.0)

    def _prefetch(self) -> Iterator[Batch]:
        copy_stream = torch.cuda.Stream(self.device)
        compute_stream = torch.cuda.current_stream(self.device)
        source = iter(self.batches)
        in_flight: deque[tuple[Batch, torch.cuda.Event | None]] = deque()

        def issue_next() -> bool:
            try:
                host = next(source)
            except StopIteration:
                return False
            in_flight.append(self._issue(host, copy_stream))
            return True

        for _ in range(self.depth):
            if not issue_next():
                break
        while in_flight:
            batch, copied = in_flight.popleft()
            batch = self._hand_over(batch, copied, compute_stream)
            issue_next()
            yield batch


class _Failed:
    def __init__(self, exc: BaseException):
        self.exc = exc


_END = object()


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
