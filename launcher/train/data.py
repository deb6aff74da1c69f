"""Where each step's batch comes from: the epoch's order, this rank's shard of it, and the data path.

Order: every epoch draws one permutation of the training set from (seed, epoch), identical on every
rank. Step s takes rows s*B .. (s+1)*B of it (B the GLOBAL batch); under ddp rank r takes the r-th
contiguous B/world slice of those rows. So the ranks' shards are disjoint, together they are exactly
the epoch's batches, and one step sees the same images however many devices share it.

Data paths (`data.placement`):
- gpu:  the whole split lives on the device as uint8 (CIFAR-10's train split is 150 MB); a batch is
        one gather there, and the host never touches pixels during training.
- host: the split stays in host memory; a background thread gathers each step's rows into pinned
        memory and a CudaPrefetcher copies them on a side stream, `data.prefetch_depth` steps ahead.
- auto: gpu when the data takes at most a quarter of the device's free memory, else host.
On a CPU device the data simply stays where it is.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from launcher.config import DataConfig, Placement
from launcher.strategies import check_batch_splits
from launcher.train.prefetch import CudaPrefetcher

if TYPE_CHECKING:
    from launcher.recipes import Splits

AUTO_GPU_SHARE = 0.25  # `auto` keeps data on the GPU when it needs at most this share of free memory


def epoch_permutation(n: int, seed: int, epoch: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 100_003 + epoch)
    return torch.randperm(n, generator=g)


def rank_order(n: int, global_batch: int, seed: int, epoch: int, world_size: int = 1, rank: int = 0) -> torch.Tensor:
    """This rank's sample indices for each step of `epoch`, shape (steps, global_batch // world_size).

    The tail of the permutation that does not fill a whole global batch is dropped (a different tail
    each epoch), so every step has the same shape on every rank.
    """
    check_batch_splits(global_batch, world_size)  # checked before launch too; a direct caller gets the same error
    steps = n // global_batch
    order = epoch_permutation(n, seed, epoch)[: steps * global_batch].view(steps, global_batch)
    per_rank = global_batch // world_size
    return order[:, rank * per_rank:(rank + 1) * per_rank]


def eval_chunks(n: int, chunk: int, world_size: int = 1, rank: int = 0) -> list[torch.Tensor]:
    """This rank's share of an evaluation set (every world_size-th sample), in chunks of `chunk`."""
    shard = torch.arange(rank, n, world_size)
    return list(shard.split(chunk))


def choose_placement(requested: Placement | str, device: torch.device, nbytes: int) -> tuple[str, str]:
    """(placement, why) for a dataset of `nbytes` on `device`."""
    requested = str(requested)
    if device.type != "cuda":
        return "host", "the device is the CPU"
    if requested != "auto":
        return requested, f"data.placement={requested}"
    free, _ = torch.cuda.mem_get_info(device)
    fits = nbytes <= AUTO_GPU_SHARE * free
    verdict = "fits" if fits else "does not fit"
    return ("gpu" if fits else "host"), (f"data.placement=auto: {nbytes / 2**20:,.0f} MB {verdict} in a quarter "
                                         f"of the {free / 2**30:,.1f} GiB free on the GPU")


class ResidentData:
    """A split held on the training device (or on the CPU when that is the device)."""

    placement = "gpu"

    def __init__(self, x: torch.Tensor, y: torch.Tensor, device: torch.device):
        self.x, self.y = x.to(device), y.to(device)
        self.device = device
        if device.type != "cuda":
            self.placement = "host"

    def __len__(self) -> int:
        return len(self.y)

    def batches(self, rows: Iterable[torch.Tensor]) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """(x, y, indices) per row of indices, all on the device."""
        if isinstance(rows, torch.Tensor):
            rows = rows.to(self.device)  # one copy per epoch, not one per step
        for idx in rows:
            idx = idx.to(self.device, non_blocking=True)
            yield self.x[idx], self.y[idx], idx


class HostData:
    """A split held in host memory, streamed to the device through pinned buffers and a side stream."""

    placement = "host"

    def __init__(self, x: torch.Tensor, y: torch.Tensor, device: torch.device, depth: int = 2):
        self.x, self.y = x.contiguous(), y.contiguous()
        self.device = device
        self.depth = depth

    def __len__(self) -> int:
        return len(self.y)

    def batches(self, rows: Sequence[torch.Tensor]) -> Iterator[tuple[torch.Tensor, ...]]:
        gathered = _Gatherer(self.x, self.y, rows, pin=self.device.type == "cuda", depth=self.depth)
        try:
            yield from CudaPrefetcher(gathered, self.device, depth=self.depth)
        finally:
            gathered.stop()


class _Gatherer:
    """Gathers rows into (pinned) host tensors on a background thread, a few steps ahead.

    torch's index_select releases the GIL, so the gathering overlaps the training loop's Python.
    """

    def __init__(self, x: torch.Tensor, y: torch.Tensor, rows: Sequence[torch.Tensor], pin: bool, depth: int):
        self.x, self.y, self.rows, self.pin = x, y, rows, pin
        self.ready: queue.Queue = queue.Queue(maxsize=depth + 1)
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="launcher-gather", daemon=True)
        self.thread.start()

    def _gather(self, source: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        out = torch.empty((len(idx), *source.shape[1:]), dtype=source.dtype, pin_memory=self.pin)
        return torch.index_select(source, 0, idx, out=out)

    def _run(self) -> None:
        try:
            for idx in self.rows:
                idx = idx.cpu()
                item = (self._gather(self.x, idx), self._gather(self.y, idx), idx)
                if not self._put(item):
                    return
        except BaseException as exc:  # handed to the consumer, which re-raises it in the training loop
            self._put(exc)
            return
        self._put(None)

    def _put(self, item) -> bool:
        while not self.stopping.is_set():
            try:
                self.ready.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self) -> Iterator[tuple[torch.Tensor, ...]]:
        while True:
            item = self.ready.get()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(timeout=5)


def make_data(x: torch.Tensor, y: torch.Tensor, device: torch.device, placement: str, depth: int):
    if placement == "gpu" or device.type != "cuda":
        return ResidentData(x, y, device)
    return HostData(x, y, device, depth)


@dataclass
class Data:
    """A run's data where it trains: both splits on their data path, and how a batch is normalized."""

    train: ResidentData | HostData
    test: ResidentData | HostData
    placement: str
    why: str  # why that placement
    megabytes: float
    num_classes: int
    synthetic: bool
    mean: torch.Tensor  # (1, C, 1, 1) on the device
    std: torch.Tensor
    channels_last: bool  # batches go to the model in channels_last layout
    host_train_x: torch.Tensor  # the training images as loaded (a sample of them sets some models up)

    @classmethod
    def place(cls, splits: Splits, options: DataConfig, device: torch.device, channels_last: bool) -> Data:
        tensors = (splits.train_x, splits.train_y, splits.test_x, splits.test_y)
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        placement, why = choose_placement(options.placement, device, nbytes)
        depth = options.prefetch_depth
        return cls(make_data(splits.train_x, splits.train_y, device, placement, depth),
                   make_data(splits.test_x, splits.test_y, device, placement, depth), placement, why, nbytes / 2**20,
                   splits.num_classes, splits.synthetic,
                   torch.tensor(splits.mean, device=device).view(1, -1, 1, 1),
                   torch.tensor(splits.std, device=device).view(1, -1, 1, 1),
                   channels_last and device.type == "cuda" and splits.train_x.dim() == 4, splits.train_x)

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        x = (x.float() - self.mean) / self.std
        return x.contiguous(memory_format=torch.channels_last) if self.channels_last else x
