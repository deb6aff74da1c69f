"""A recipe's own Datasets as a data path: the launcher's order, torch's DataLoader, the side-stream copy.

A recipe whose `load` returns `(train, eval)` Datasets gets the same seam as the in-memory splits
(launcher/data/placement.py): the loop asks a split for its length and for `batches(rows)`, where `rows`
is this rank's share of the epoch's global order (`rank_order`: one permutation per (seed, epoch),
the same for any number of ranks, so a resume on another world size, or in the middle of an epoch,
continues it). Here those rows become a DataLoader's batch sampler:

    rows (this rank's indices, step by step, each index with its epoch)
      -> DataLoader(dataset, batch_sampler=rows, num_workers=data.workers, pin_memory, persistent
                    workers, prefetch_factor=data.worker_prefetch, collate=recipe.collate)
      -> CudaPrefetcher: every tensor of the batch copied to the GPU on a side stream,
         data.prefetch_depth batches ahead, then recipe.on_after_batch_transfer on that stream (issued
         from a thread of its own when the recipe has one: GPU decoding that blocks its thread never
         holds up the training step's launches)
      -> (batch, indices) for the step

One pass of the DataLoader serves every training epoch: its batch sampler goes on from an epoch's last
row to the next epoch's first (the loop's order for it, asked when reached), so the workers read the next
epoch's first batches while this epoch's last ones train. Restarting the DataLoader at each epoch would
leave the GPU idle at every epoch's start until a worker had read a whole batch (ResNet-50 on one H100,
20,000 JPEGs: a noticeable part of each epoch; measured: BENCHMARKS.md section 12). The epoch travels with
each batch's indices, and a Dataset with `set_epoch` is told the epoch in the process that reads the
batch, before its first batch of that epoch (each worker process has its own copy of the Dataset):
augmentation drawn per (epoch, sample) stays exact however far ahead the workers read. An evaluation, a
warm-up, a resumed epoch's remainder or an epoch that was left early starts a pass of its own.

A sample the Dataset returns as None (a bad file it chose to skip) is left out of its batch and
counted (`skipped`, on the host: no device sync). An IterableDataset has no indices to order: each
rank takes every world_size-th sample of the stream (its workers read that share a whole batch each in
turn: `_RankShard`), and a training stream must say its length (`__len__`: samples per epoch) so every
rank runs the same number of steps; a resumed epoch's rest reads past the batches trained before.

A training Dataset whose decoding is on trial (its `trial`: data.decode=auto's DecodeTrial) is fed here,
whatever its data kind: the recipe's on_after_batch_transfer is timed on the prefetch thread for it, and
it reads the training steps' own times from the split's `pace`, which the loop's StepClock fills.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from launcher.config import DataConfig
from launcher.data.hooks import DataHooks, transfers
from launcher.data.pace import StepPace
from launcher.data.prefetch import CudaPrefetcher, batch_len
from launcher.errors import ConfigError


def default_workers(local_ranks: int) -> int:
    """DataLoader workers per rank when `data.workers` is not set: the cores this process may use,
    shared by the ranks on this machine, less one for the training loop itself."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(0, cores // max(1, local_ranks) - 1)


def rank_workers(options: DataConfig) -> int:
    """This rank's DataLoader workers, known before its loaders exist (a recipe's load sizes its decoding by
    them): data.workers, or when null `default_workers` over the ranks on this machine (LOCAL_WORLD_SIZE)."""
    if options.workers is not None:
        return int(options.workers)
    return default_workers(int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))


def _tied_to_rank(worker_id: int) -> None:
    from launcher.lifetime import die_with_parent

    die_with_parent()


def _start(loader: DataLoader) -> Iterator[Any]:
    """iter(loader). Where that forks the workers (a new pass of a DataLoader whose workers are not running),
    the rank's garbage is collected first and what lives is frozen (gc.freeze): a forked worker's garbage
    collector then never frees an object it inherited. A CUDA tensor freed in a forked child aborts it
    ("CUDA error: initialization error": seen in a DataLoader worker of an imagefolder run resumed on one
    H200 with data.decode=gpu, its garbage collector running during an import)."""
    if loader.num_workers > 0 and getattr(loader, "_iterator", None) is None:
        from launcher import heap

        heap.freeze()
    return iter(loader)


class _Plan:
    """The DataLoader's batch sampler: each batch as [(epoch, index), ...]. A pass starts with the rows
    it is given (`begin`), then, where it has `upcoming` (epoch -> this rank's rows, None past the last
    epoch), goes on epoch after epoch, asking for each one's rows when it reaches them. Persistent
    workers keep the DataLoader, which asks its batch sampler afresh at each pass."""

    def __init__(self) -> None:
        self.epoch: int | None = None
        self.rows: list[list[int]] = []
        self.upcoming: Callable[[int], torch.Tensor | None] | None = None
        self.asked: dict[int, torch.Tensor] = {}  # the rows `upcoming` gave, by epoch, until they are taken

    def begin(self, epoch: int | None, rows: list[list[int]],
              upcoming: Callable[[int], torch.Tensor | None] | None) -> None:
        self.epoch, self.rows, self.upcoming = epoch, rows, upcoming
        self.asked = {}

    def __iter__(self) -> Iterator[list[tuple[int | None, int]]]:
        epoch, rows = self.epoch, self.rows
        while True:
            for row in rows:  # (an upcoming epoch's rows: a tensor, made lists a batch at a time)
                yield [(epoch, i) for i in (row.tolist() if isinstance(row, torch.Tensor) else row)]
            if epoch is None or self.upcoming is None:
                return
            epoch += 1
            following = self.upcoming(epoch)
            if following is None:
                return
            self.asked[epoch] = rows = following

    def __len__(self) -> int:
        return len(self.rows)


class _Epoched(torch.utils.data.Dataset):
    """The recipe's map-style Dataset read by (epoch, index) keys, a batch at a time: a Dataset with
    `set_epoch` is told a batch's epoch before its samples are read, in the process that reads them."""

    def __init__(self, dataset: Any):
        self.dataset = dataset
        self.epoch: int | None = None  # the epoch this process last told the Dataset
        self.tell = callable(getattr(dataset, "set_epoch", None))
        self.many = callable(getattr(dataset, "__getitems__", None))

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitems__(self, keys: list[tuple[int | None, int]]) -> list[Any]:
        epoch = keys[0][0] if keys else None
        if self.tell and epoch is not None and epoch != self.epoch:
            self.dataset.set_epoch(epoch)
            self.epoch = epoch
        indices = [i for _, i in keys]
        if self.many:
            return list(self.dataset.__getitems__(indices))
        return [self.dataset[i] for i in indices]

    def __getitem__(self, key: tuple[int | None, int]) -> Any:
        return self.__getitems__([key])[0]


@dataclass
class _Pass:
    """A DataLoader pass kept between epochs: its iterator, and the epoch whose rows come next from it."""

    batches: Iterator[Any]
    next_epoch: int | None


class _Collate:
    """The recipe's collate over the samples that are not None; returns (batch, how many were None)."""

    def __init__(self, collate: Callable[[list[Any]], Any]):
        self.collate = collate

    def __call__(self, samples: list[Any]) -> tuple[Any, int]:
        kept = [s for s in samples if s is not None]
        if not kept:
            return None, len(samples)
        return self.collate(kept), len(samples) - len(kept)


class _RankShard(IterableDataset):
    """An IterableDataset's share for one rank and one of its DataLoader workers. The rank keeps every
    world_size-th sample of the stream (the ranks' shares are disjoint and together the whole stream); its
    share is cut into batches of `batch` consecutive samples, and worker w of W reads batches w, w + W, ...:
    the DataLoader takes its workers' batches in turn, so the rank trains its share in order, every batch full
    but the share's last. (Splitting the share sample by sample among the workers made each worker end in a
    partial batch: a training step of 2 samples where 4 were due, and the samples after it never trained.)

    `epoch` (shared memory, set by the rank before each pass) is told to the Dataset's `set_epoch` in the
    process that reads it: persistent workers keep their own copy of the Dataset, which the rank's call
    never reached (every epoch read in the order of the first)."""

    def __init__(self, dataset: Iterable[Any], world_size: int, rank: int, batch: int):
        self.dataset, self.world_size, self.rank, self.batch = dataset, world_size, rank, max(1, batch)
        self.epoch = torch.full((), -1, dtype=torch.long).share_memory_()
        self.tell = callable(getattr(dataset, "set_epoch", None))

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        epoch = int(self.epoch)
        if self.tell and epoch >= 0:
            self.dataset.set_epoch(epoch)
        for i, sample in enumerate(self.dataset):
            if i % self.world_size == self.rank and (i // self.world_size // self.batch) % workers == worker:
                yield sample


class DatasetSplit:
    """One split of a recipe's Datasets, streamed through a DataLoader to the device."""

    placement = "workers"

    def __init__(self, dataset: Any, recipe: DataHooks, options: DataConfig, device: torch.device, training: bool,
                 world_size: int, rank: int, local_ranks: int, per_rank_batch: int,
                 upcoming: Callable[[int], torch.Tensor | None] | None = None):
        """`upcoming(epoch)`: this rank's rows of that epoch (None past the last one), for a training
        split whose workers read on into the next epoch."""
        self.dataset = dataset
        self.recipe = recipe
        self.device = device
        self.training = training
        self.depth = options.prefetch_depth
        self.iterable = isinstance(dataset, IterableDataset)
        self.workers = options.workers if options.workers is not None else default_workers(local_ranks)
        self.skipped = 0  # samples the Dataset returned as None, since `skipped` was last reset
        pin = device.type == "cuda"
        common: dict[str, Any] = {"num_workers": self.workers, "pin_memory": pin,
                                  "collate_fn": _Collate(recipe.collate), "persistent_workers": self.workers > 0}
        if self.workers > 0:
            # Forked from this rank (not from launch's forkserver, the process-wide default here): they
            # are its children, and die with it (parent-death signal) however it ends.
            common.update(prefetch_factor=options.worker_prefetch, multiprocessing_context="fork",
                          worker_init_fn=_tied_to_rank)
        self.upcoming = upcoming if training and self.workers > 0 else None
        self._pass: _Pass | None = None  # the training pass that reads ahead into the next epoch
        # A training Dataset whose decoding is on trial (data.decode=auto: decode_trial.py) has its batches
        # timed here, against the training steps' own times: the loop's StepClock writes them to `pace`.
        self.trial = getattr(dataset, "trial", None) if training else None
        self.pace = StepPace() if self.trial is not None else None
        if self.trial is not None:
            self.trial.pace = self.pace.median_s
        if self.iterable:
            self.length = _length(dataset)
            self.world_size = world_size
            self.shard = _RankShard(dataset, world_size, rank, per_rank_batch)
            self.loader = DataLoader(self.shard, batch_size=max(1, per_rank_batch), **common)
        else:
            self.length = len(dataset)
            self.plan = _Plan()
            self.loader = DataLoader(_Epoched(dataset), batch_sampler=self.plan, **common)

    def __len__(self) -> int:
        return self.length or 0

    def close(self) -> None:
        """Stop the DataLoader's workers now, while this process's threads still run (left to the iterator's
        `__del__` at teardown, each worker was waited for 5 s: the stop message never reached it)."""
        self._pass = None
        iterator = getattr(self.loader, "_iterator", None)
        shutdown = getattr(iterator, "_shutdown_workers", None)
        if callable(shutdown):
            shutdown()
        self.loader._iterator = None

    def batches(self, rows: Iterable[torch.Tensor] | torch.Tensor,
                epoch: int | None = None) -> Iterator[tuple[Any, torch.Tensor]]:
        """(batch on the device, its sample indices on the host) for each row of indices (map-style); for a
        stream, as many of its batches as there are rows (`rows` only counts the steps then). `epoch`: the
        epoch these rows are of (None: outside the epochs, as a warm-up's), told to a Dataset with
        `set_epoch` (augmentation drawn per epoch); a training pass started at an epoch reads on into the
        next, which continues it when its rows are the ones planned."""
        whole = rows if isinstance(rows, torch.Tensor) else None
        rows = [r.tolist() if isinstance(r, torch.Tensor) else list(r) for r in rows]
        if self.iterable and epoch is not None:
            self.shard.epoch.fill_(epoch)  # (told to the Dataset in the process that reads it)
            if callable(getattr(self.dataset, "set_epoch", None)):
                self.dataset.set_epoch(epoch)
        if not rows and not (self.iterable and not self.training):
            return
        if self.iterable:  # (evaluation: the whole of this rank's share of the stream)
            # A training epoch's rest (resumed at a step): its first batches are read past, not trained again.
            whole = self.length // (self.world_size * len(rows[0])) if self.training and epoch is not None else 0
            source = self._stream(len(rows) if self.training else None, skip=max(0, whole - len(rows)))
        else:
            source = zip(self._counted(self._read(rows, whole, epoch)), rows, strict=False)
        after = None
        if transfers(self.recipe):
            def after(item: tuple[Any, Any]) -> tuple[Any, Any]:
                return self.recipe.on_after_batch_transfer(item[0], self.training), item[1]

            if self.trial is not None:
                after = self.trial.timed(after)
        # (a recipe's GPU work on its batches, decoding say, is issued from a thread of its own: see prefetch.py)
        for batch, idx in CudaPrefetcher(((b, torch.as_tensor(i)) for b, i in source), self.device,
                                         depth=self.depth, after=after, threaded=after is not None):
            yield batch, idx

    def _read(self, rows: list[list[int]], whole: torch.Tensor | None, epoch: int | None) -> Iterator[Any]:
        """The DataLoader's batches for `rows`: from the pass already reading them ahead, where there is
        one and these are the rows it planned, else from a new pass. (A new pass is started here, in the
        loop's thread, not where its batches are taken: a worker dies with the thread that forked it.)"""
        current, self._pass = self._pass, None
        if not (current is not None and epoch is not None and current.next_epoch == epoch and whole is not None
                and _same(whole, self.plan.asked.pop(epoch, None))):
            # (a new pass: a persistent DataLoader drops what its workers had read ahead)
            self.plan.begin(epoch, rows, self.upcoming if epoch is not None else None)
            current = _Pass(_start(self.loader), epoch)
        return self._take(current, len(rows), epoch + 1 if epoch is not None and self.upcoming else None)

    def _take(self, current: _Pass, n: int, then: int | None) -> Iterator[Any]:
        """The pass's next `n` batches; once all are taken, it is kept for epoch `then` to go on from."""
        for _ in range(n):
            try:
                batch = next(current.batches)
            except StopIteration:  # (fewer than planned: the loop's zip with its rows ends there)
                return
            yield batch
        if then is not None:
            current.next_epoch, self._pass = then, current

    def _counted(self, batches: Iterator[tuple[Any, int]]) -> Iterator[Any]:
        for batch, skipped in batches:
            self.skipped += skipped
            if batch is None:
                raise ValueError(f"every sample of a batch was skipped (the Dataset returned None for all "
                                 f"{skipped}); check the data, or lower data.on_bad_file's tolerance")
            yield batch

    def _stream(self, steps: int | None, skip: int = 0) -> Iterator[tuple[Any, list[int]]]:
        """A stream's batches for `steps` steps (None: to its end), after its first `skip` batches (read and
        dropped); a training stream that ends first on this rank is an error (the other ranks would wait for
        it at their next collective). A batch's indices are its samples' places in this rank's share."""
        got = seen = 0
        for got, batch in enumerate(self._counted(_start(self.loader)), start=1):
            n = batch_len(batch)
            if got > skip:
                yield batch, list(range(seen, seen + n))
            seen += n
            if steps is not None and got == skip + steps:
                return
        got = max(0, got - skip)
        if self.training:
            raise ValueError(f"the training IterableDataset ended after {got} batches on this rank, where its "
                             f"__len__ ({self.length} samples) promised {steps} steps of the epoch; make __len__ "
                             "the samples it yields per epoch")


def _same(a: torch.Tensor, b: torch.Tensor | None) -> bool:
    return b is not None and a.shape == b.shape and torch.equal(a, b)


def _length(dataset: Any) -> int | None:
    try:
        return len(dataset)
    except TypeError:
        return None


def check_datasets(train: Any, test: Any, recipe_name: str) -> None:
    """What the loop needs of a recipe's (train, eval) Datasets, as one line each."""
    from torch.utils.data import Dataset

    for what, ds in (("train", train), ("eval", test)):
        if not isinstance(ds, (Dataset, IterableDataset)) and not (hasattr(ds, "__getitem__")
                                                                   and hasattr(ds, "__len__")):
            raise ConfigError("recipe", recipe_name, f"load() returned a {type(ds).__name__} as the {what} split; "
                              "return (train, eval) as torch Datasets (map-style: __getitem__ and __len__, or "
                              "an IterableDataset)", f"recipe={recipe_name}")
    if isinstance(train, IterableDataset) and _length(train) is None:
        raise ConfigError("recipe", recipe_name, "the training IterableDataset has no __len__: every rank must "
                          "know how many steps an epoch has; give it __len__ (samples per epoch)",
                          f"recipe={recipe_name}")
