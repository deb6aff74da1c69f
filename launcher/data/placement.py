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

Token streams (a recipe's `TokenSplits`, e.g. recipe=text) take the same two paths: the stream on the
device (one gather of windows per step), or memory-mapped on the host, windows gathered into pinned
memory by the background thread and copied on the side stream; only the pages sampled are read.
A training sample is a window starting at any token, drawn at random (with replacement) per
(seed, epoch); an epoch draws as many windows as the stream holds end to end. Held-out windows tile
the test stream without overlap.
"""

from __future__ import annotations

import queue
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from launcher.config import DataConfig, Placement
from launcher.data.prefetch import CudaPrefetcher
from launcher.strategies import check_batch_splits

if TYPE_CHECKING:
    from launcher.data.hooks import Splits, TokenSplits
    from launcher.data.loader import DatasetSplit
    from launcher.data.pace import StepPace

AUTO_GPU_SHARE = 0.25  # `auto` keeps data on the GPU when it needs at most this share of free memory


def epoch_permutation(n: int, seed: int, epoch: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 100_003 + epoch)
    return torch.randperm(n, generator=g)


def rank_order(n: int, global_batch: int, seed: int, epoch: int, world_size: int = 1, rank: int = 0,
               drawn: int | None = None) -> torch.Tensor:
    """This rank's sample indices for each step of `epoch`, shape (steps, global_batch // world_size).

    The tail of the permutation that does not fill a whole global batch is dropped (a different tail
    each epoch), so every step has the same shape on every rank. With `drawn`, the epoch is that many
    samples drawn at random from the n with replacement (windows of a token stream).
    """
    check_batch_splits(global_batch, world_size)  # checked before launch too; a direct caller gets the same error
    steps = (n if drawn is None else drawn) // global_batch
    if drawn is None:
        order = epoch_permutation(n, seed, epoch)[: steps * global_batch]
    else:
        g = torch.Generator().manual_seed(seed * 100_003 + epoch)
        order = torch.randint(n, (steps * global_batch,), generator=g)
    order = order.view(steps, global_batch)
    per_rank = global_batch // world_size
    return order[:, rank * per_rank:(rank + 1) * per_rank]


def eval_chunks(n: int, chunk: int, world_size: int = 1, rank: int = 0,
                equal_counts: bool = False) -> list[torch.Tensor]:
    """This rank's share of an evaluation set (every world_size-th sample), in chunks of `chunk`.
    `equal_counts`: as many chunks on every rank (of at most `chunk`), for models whose forward is a
    collective (fsdp)."""
    shard = torch.arange(rank, n, world_size)
    if equal_counts:
        longest = -(-n // world_size)
        return list(shard.tensor_split(-(-longest // chunk)))
    return list(shard.split(chunk))


def warm_up_chunks(mine: list[torch.Tensor], n: int, chunk: int, world_size: int,
                   lockstep: bool) -> list[torch.Tensor]:
    """The chunks an evaluation's warm-up runs (one forward of each chunk size, so compiling and cuDNN's
    autotuning stay out of the timed evaluation): one of each size among this rank's chunks `mine`; where
    every rank's forward is a collective (`lockstep`, fsdp), one of each size that ANY rank's chunks have,
    in the same order on every rank. (Each rank's own sizes differ where the split is uneven, [16, 16]
    against [16, 15]: the rank with the extra forward waited forever in its all-gather, seen on 2x H200.)"""
    if not lockstep or world_size == 1:
        return list({len(c): c for c in mine}.values())
    sizes = sorted({len(c) for r in range(world_size) for c in eval_chunks(n, chunk, world_size, r, True)})
    return [torch.arange(size) for size in sizes]


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

    def batches(self, rows: Iterable[torch.Tensor],
                epoch: int | None = None) -> Iterator[tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]]:
        """((x, y), indices) per row of indices, all on the device (`epoch`, which the rows are of, is for
        data paths that read ahead: loader.py)."""
        if isinstance(rows, torch.Tensor):
            rows = to_device(rows, self.device)  # one copy per epoch, not one per step
        for idx in rows:
            idx = idx.to(self.device, non_blocking=True)
            yield (self.x[idx], self.y[idx]), idx


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` on `device` without the host waiting for the GPU: a copy from pageable memory waits for the
    stream's queued work (the epoch before, its evaluation), a copy from pinned memory does not."""
    if device.type != "cuda" or t.device == device:
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


class HostData:
    """A split held in host memory, streamed to the device through pinned buffers and a side stream."""

    placement = "host"

    def __init__(self, x: torch.Tensor, y: torch.Tensor, device: torch.device, depth: int = 2):
        self.x, self.y = x.contiguous(), y.contiguous()
        self.device = device
        self.depth = depth

    def __len__(self) -> int:
        return len(self.y)

    def batches(self, rows: Sequence[torch.Tensor], epoch: int | None = None) -> Iterator[tuple[torch.Tensor, ...]]:
        pin = self.device.type == "cuda"

        def take(idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return _gather(self.x, idx, pin), _gather(self.y, idx, pin)

        gathered = _Gatherer(take, rows, depth=self.depth)
        try:
            for x, y, idx in CudaPrefetcher(gathered, self.device, depth=self.depth):
                yield (x, y), idx
        finally:
            gathered.stop()


def _gather(source: torch.Tensor, idx: torch.Tensor, pin: bool) -> torch.Tensor:
    out = torch.empty((len(idx), *source.shape[1:]), dtype=source.dtype, pin_memory=pin)
    return torch.index_select(source, 0, idx, out=out)


class _Gatherer:
    """Gathers each step's rows into (pinned) host tensors on a background thread, a few steps ahead.

    `take(idx) -> (x, y)` does the gathering; torch's indexing releases the GIL, so it overlaps the
    training loop's Python.
    """

    def __init__(self, take: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
                 rows: Sequence[torch.Tensor], depth: int):
        self.take, self.rows = take, rows
        self.ready: queue.Queue = queue.Queue(maxsize=depth + 1)
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="launcher-gather", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            for idx in self.rows:
                idx = idx.cpu()
                item = (*self.take(idx), idx)
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


class TokenWindows:
    """Windows of a token stream: sample i is the `context` tokens from i * stride, its targets the same
    window one token on. The stream stays on the device (placement gpu, or a CPU device) or in host
    memory (a memory map: only the pages sampled are read), windows gathered into pinned memory on the
    background thread and copied on the side stream.

    `stream` may also be a list of shards (1-D tensors: memory-mapped token files). Windows never cross a
    shard's end: window i is the j-th of shard k, found from the cumulative window counts (searchsorted),
    and a shard shorter than a window gives none. On the device the shards lie end to end in one tensor
    (each copied once, straight into its place) and a window starts at its shard's base + j * stride, so
    a step stays one gather; on the host the shards stay separate maps, each window gathered from its own."""

    def __init__(self, stream: torch.Tensor | Sequence[torch.Tensor], context: int, stride: int,
                 device: torch.device, placement: str, depth: int = 2):
        self.context, self.stride, self.device, self.depth = context, stride, device, depth
        self.placement = "gpu" if placement == "gpu" and device.type == "cuda" else "host"
        self.shards: list[torch.Tensor] | None = None  # shards kept apart (on the host)
        self.bases: torch.Tensor | None = None  # where each shard starts in self.stream (on the device)
        self.mask: int | None = None  # uint16/uint32 on the GPU: held as int16/int32, gathered ids masked back
        if isinstance(stream, torch.Tensor):
            self.stream = self._signed(stream.to(device)) if self.placement == "gpu" else stream
            self.offsets = torch.arange(context + 1, device=self.stream.device)
            self.windows = (len(stream) - context - 1) // stride + 1  # each with its targets inside the stream
            return
        on = device if self.placement == "gpu" else torch.device("cpu")
        self.offsets = torch.arange(context + 1, device=on)
        counts = [max(0, (len(s) - context - 1) // stride + 1) for s in stream]
        shards = [s for s, n in zip(stream, counts, strict=True) if n > 0]
        counts = [n for n in counts if n > 0]
        self.windows = sum(counts)
        ends = torch.tensor(counts, dtype=torch.long).cumsum(0)
        self.window_ends = ends.to(on)  # window i lies in shard searchsorted(window_ends, i, right=True)
        self.first_window = (ends - torch.tensor(counts, dtype=torch.long)).to(on)
        if self.placement == "host":
            self.shards = shards
            return
        self.stream = torch.empty(sum(len(s) for s in shards), dtype=shards[0].dtype if shards else torch.uint8,
                                  device=device)
        bases = [0]
        for shard in shards:
            self.stream[bases[-1]:bases[-1] + len(shard)].copy_(shard)
            bases.append(bases[-1] + len(shard))
        self.bases = torch.tensor(bases[:-1], dtype=torch.long, device=device)
        self.stream = self._signed(self.stream)

    def _signed(self, stream: torch.Tensor) -> torch.Tensor:
        """CUDA cannot index uint16 or uint32 tensors (torch 2.11-2.13: "index_cuda" not implemented), so
        such a stream is viewed as int16/int32 (the same bits, no copy) and `take` masks the ids back."""
        if stream.dtype in (torch.uint16, torch.uint32):
            self.mask = (1 << 8 * stream.element_size()) - 1
            return stream.view(torch.int16 if stream.dtype == torch.uint16 else torch.int32)
        return stream

    def __len__(self) -> int:
        return self.windows

    def take(self, idx: torch.Tensor, pin: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) as int64, (len(idx), context) each, where the stream is."""
        if self.shards is None and self.bases is None:  # one stream
            starts = idx.to(self.stream.device, non_blocking=True) * self.stride
            windows = self.stream[starts[:, None] + self.offsets].long()
        else:
            idx = idx.to(self.offsets.device, non_blocking=True)
            shard = torch.searchsorted(self.window_ends, idx, right=True)
            start = (idx - self.first_window[shard]) * self.stride  # in its shard
            if self.bases is not None:  # shards end to end on the device: one gather
                windows = self.stream[(self.bases[shard] + start)[:, None] + self.offsets].long()
            else:  # separate maps on the host: each shard's windows gathered from it
                windows = torch.empty((len(idx), self.context + 1), dtype=torch.long, pin_memory=pin)
                for k in shard.unique().tolist():
                    rows = (shard == k).nonzero().squeeze(1)
                    windows[rows] = self.shards[k][start[rows, None] + self.offsets].long()
                return windows[:, :-1], windows[:, 1:]
        if self.mask is not None:
            windows &= self.mask
        if pin:
            windows = windows.pin_memory()
        return windows[:, :-1], windows[:, 1:]

    def batches(self, rows: Iterable[torch.Tensor], epoch: int | None = None) -> Iterator[tuple[torch.Tensor, ...]]:
        if self.placement == "gpu" or self.device.type != "cuda":
            if isinstance(rows, torch.Tensor):
                rows = to_device(rows, self.device)
            for idx in rows:
                idx = idx.to(self.device, non_blocking=True)
                yield self.take(idx), idx
            return
        gathered = _Gatherer(lambda idx: self.take(idx, pin=True), list(rows), depth=self.depth)
        try:
            for x, y, idx in CudaPrefetcher(gathered, self.device, depth=self.depth):
                yield (x, y), idx
        finally:
            gathered.stop()


def make_data(x: torch.Tensor, y: torch.Tensor, device: torch.device, placement: str, depth: int):
    if placement == "gpu" or device.type != "cuda":
        return ResidentData(x, y, device)
    return HostData(x, y, device, depth)


@dataclass
class Data:
    """A run's data where it trains: both splits on their data path, and how a batch is normalized."""

    train: ResidentData | HostData | TokenWindows | DatasetSplit
    test: ResidentData | HostData | TokenWindows | DatasetSplit
    placement: str
    why: str  # why that placement
    megabytes: float
    num_classes: int  # classes, or a token stream's vocabulary
    synthetic: bool
    mean: torch.Tensor | None  # (1, C, 1, 1) on the device; None for tokens (no normalization)
    std: torch.Tensor | None
    channels_last: bool  # batches go to the model in channels_last layout
    host_train_x: torch.Tensor | None  # the training images as loaded (a sample of them sets some models up)
    targets_per_sample: int = 1  # what a sample's loss averages over: 1 label, or a window's tokens
    unit: str = "img"  # what throughput counts: img (samples) or tokens
    drawn_per_epoch: int | None = None  # samples drawn at random per epoch (windows), else a permutation of all
    # Splits and token streams: batch[0] goes through `normalize` (and the recipe's augmentation) in the
    # step; a recipe's Datasets (launcher/data/loader.py) arrive as their collate and
    # on_after_batch_transfer made them
    in_memory: bool = True

    def close(self) -> None:
        """Stop whatever feeds the splits in other processes (a recipe's DataLoader workers)."""
        for split in (self.train, self.test):
            close = getattr(split, "close", None)
            if callable(close):
                close()

    @classmethod
    def place_tokens(cls, splits: TokenSplits, options: DataConfig, device: torch.device) -> Data:
        import numpy as np

        def as_tensor(a) -> torch.Tensor:
            # No copy: a memory map stays one. (torch warns of arrays it could write to that are read-only;
            # nothing here writes to the stream.)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                return torch.from_numpy(np.asarray(a))

        def as_tensors(a) -> torch.Tensor | list[torch.Tensor]:  # one stream, or a list of shards
            return [as_tensor(s) for s in a] if isinstance(a, (list, tuple)) else as_tensor(a)

        train, test = as_tensors(splits.train), as_tensors(splits.test)
        streams = [t for split in (train, test) for t in (split if isinstance(split, list) else [split])]
        nbytes = sum(t.numel() * t.element_size() for t in streams)
        placement, why = choose_placement(options.placement, device, nbytes)
        depth, context = options.prefetch_depth, splits.context
        targets = sum(len(t) - 1 for t in (train if isinstance(train, list) else [train]))
        return cls(TokenWindows(train, context, 1, device, placement, depth),
                   TokenWindows(test, context, context, device, placement, depth), placement, why, nbytes / 2**20,
                   splits.vocab_size, splits.synthetic, None, None, False, None, targets_per_sample=context,
                   unit="tokens", drawn_per_epoch=targets // context)

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

    @property
    def pace(self) -> StepPace | None:
        """Where the loop's StepClock puts the training steps' own times, for a data path that tunes its
        input to them (a Dataset's DecodeTrial: loader.py); None where none does."""
        return getattr(self.train, "pace", None)

    @property
    def skipped(self) -> int:
        """Training samples the recipe's Dataset skipped (returned None) so far on this rank."""
        return getattr(self.train, "skipped", 0)

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        if self.mean is None:  # token ids go to the model as they are
            return x
        x = (x.float() - self.mean) / self.std
        return x.contiguous(memory_format=torch.channels_last) if self.channels_last else x
