"""Where a Dataset's samples are decoded, the DataLoader workers or the GPU, and data.decode=auto's measured
choice between them (DecodeTrial): for any data kind whose files a GPU decoder can take.

A `SharedDecode` Dataset makes each sample in a DataLoader worker, or leaves it to the GPU's decoder, by a
share of the samples that the rank sets while its workers run (in shared memory), and counts per worker the
samples it made and the seconds it spent: what the trial sets and reads. Its batches mark what they leave
to the GPU with a `LeftToGpu` object (not a tensor: it stays on the host through the copy to the device).

data.decode=auto on CUDA: the first training batches of the second epoch (the first one's pace is not the
run's: compiling, the warm-up, the workers starting) are decoded by the workers alone and timed, by the
steps' own time on the GPU's clock, by the time the workers need for a batch (their stock of batches made
ahead cannot hide that they do not keep up) and by the prefetch thread's. Where they keep up, that is all.
Where they fall behind, each batch is split: the share the workers make in a step's time stays with them,
the rest goes to the GPU's decoder; timed the same way, and balanced once more by its own times where they
are still apart. The fastest way is kept, said in one line with every figure.

The data layer feeds the trial, not the recipe: the loader (loader.py) times the recipe's
on_after_batch_transfer on the prefetch thread for each training batch (`DecodeTrial.timed`) and hands
the trial the training steps' own times (pace.py's StepPace, which the loop's StepClock fills).
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.utils._pytree import tree_leaves

log = logging.getLogger("launcher.train")

WORK_SLOTS = 1025  # rows of a SharedDecode's work counts: one per DataLoader worker (data.workers <= 1024), one more


def mix(*values: int) -> int:
    """A 64-bit hash of integers (splitmix64 steps), to seed a sample's own random draws."""
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = (h ^ (v & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        h = (h ^ (h >> 31)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 29
    return h


class LeftToGpu:
    """What a batch leaves to the GPU's decoder (a subclass carries it: images.py's GpuWork). Neither a
    tensor nor a container, so the DataLoader's pinning and the launcher's copy to the device leave it on
    the host; the trial finds it among the batch's leaves, however the recipe's collate nests it."""

    def gpu_samples(self) -> int:
        """How many of the batch's samples the GPU decodes."""
        raise NotImplementedError


class SharedDecode(torch.utils.data.Dataset):
    """A Dataset whose samples the DataLoader workers decode, or leave to the GPU's decoder: `gpu_share` of
    them, picked by a hash of their index (the same ones for the same share). A subclass makes a sample in
    `_sample(index)`, asking `_on_gpu(index)`; `__getitem__` counts the worker's work around it once
    `share_with_workers` was called. `trial`: the DecodeTrial choosing the share (data.decode=auto), which
    the loader feeds while it runs."""

    trial: DecodeTrial | None = None

    def __init__(self, gpu_share: float = 0.0):
        # The share of samples meant for the GPU decoder (read sample by sample; see share_with_workers).
        self._gpu_share = torch.full((1,), float(gpu_share), dtype=torch.float64)
        # Per DataLoader worker (row = worker id; the last row: no worker), the samples it made and the seconds
        # it spent making them: data.decode=auto's measure of what the workers can make (share_with_workers)
        self._work: torch.Tensor | None = None
        self._work_view: np.ndarray | None = None  # (this process's numpy view of it: cheap to add to)

    def _sample(self, index: int) -> Any:
        raise NotImplementedError

    @property
    def gpu_share(self) -> float:
        return float(self._gpu_share[0])

    @gpu_share.setter
    def gpu_share(self, share: float) -> None:
        self._gpu_share[0] = float(share)

    def share_with_workers(self) -> None:
        """Keep the share in shared memory, so that DataLoader workers forked after this follow a change made
        here while they run, and have them count their work where this process reads it (`work`;
        data.decode=auto's DecodeTrial; a run that does neither needs no shared memory for it)."""
        self._gpu_share.share_memory_()
        self._work = torch.zeros((WORK_SLOTS, 2), dtype=torch.float64).share_memory_()

    def work(self) -> torch.Tensor | None:
        """(samples made, seconds spent making them) per DataLoader worker so far; None unless shared."""
        return None if self._work is None else self._work.clone()

    def _on_gpu(self, index: int) -> bool:
        """Whether the sample is meant for the GPU decoder (under auto, the samples whose index hashes below
        the share: the same ones for the same share)."""
        share = self.gpu_share
        if share <= 0.0 or share >= 1.0:
            return share >= 1.0
        return mix(0x5EED, index) % 10_000 < share * 10_000

    def __getitem__(self, index: int) -> Any:
        if self._work is None:
            return self._sample(index)
        began = time.perf_counter()
        try:
            return self._sample(index)
        finally:
            info = torch.utils.data.get_worker_info()
            if self._work_view is None:
                self._work_view = self._work.numpy()
            row = self._work_view[info.id if info is not None and info.id < WORK_SLOTS - 1 else WORK_SLOTS - 1]
            row += (1.0, time.perf_counter() - began)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_work_view": None}  # (a view would be pickled as a copy: made again there)


class DecodeTrial:
    """data.decode=auto on CUDA: which way of decoding trains faster, measured on the run's own first
    training batches. The workers alone go first. Where they keep up with the steps, they are kept and
    nothing else is tried. Where they do not (they need longer to make a batch than a step takes, the steps
    fed meanwhile from the stock they made ahead), a split follows, sized from those two times: the share of
    each batch the workers make in a step's time (less MARGIN) stays with them, the rest goes to the GPU's
    decoder. Where that split's own times are still apart (its workers behind its steps, or idle beside
    them: the GPU's decoding changes the step; or its decoding holding the prefetch thread longer than a
    step), one more split balances them the same way. Each candidate (a share of each batch for the GPU
    decoder) is set in the Dataset (its workers read the share sample by sample) and timed over MEASURE
    training batches made under it, after its first SETTLE (the pipeline filling), by what each of the three
    that feed a step needs for a batch:

    - the steps: the median of the last MEASURE steps' own times on the GPU's clock (the launcher's
      StepPace: from the batch being ready to the step's end, input waits left out), the GPU's decoding
      beside them included. Not the gaps between batches reaching the prefetch thread: the host runs ahead
      of the GPU and catches up in bursts (on two H200s the gaps' median said far less and far more than the
      steps took, and a split was tried where the workers kept up; measured: BENCHMARKS.md section 6). The
      gaps' median stands in only where the loader gave it no StepPace (the trial driven by hand);
    - the workers: the time they need to make a batch, from what each one made and the seconds it spent
      making it (SharedDecode.work: each of them working at once, as they do). Their stock of batches
      made ahead (up to their prefetch_factor each) hides for a while that they cannot keep up, so the
      steps alone would not tell (on one H200 host the epochs then took longer a batch than the steps said
      for the workers alone; measured: BENCHMARKS.md section 12);
    - the prefetch thread: the median time on_after_batch_transfer held it (the GPU decoder returns once
      its images are decoded), the one thread every batch passes through.

    A batch takes the longest of the three. The fastest candidate is kept, said in one line; the workers
    alone win a tie within TIE (GPU decoding beside training also costs the step's host and GPU time).
    Which samples go to which decoder changes the pixels only by the two decoders' rounding: the crops,
    flips, order and resume are the same whatever is kept. (The split used to come from decoding rates
    measured apart, on other machines: far more on the GPU than the host's own workers needed; measured:
    BENCHMARKS.md section 6.)"""

    MEASURE = 24
    SETTLE = 8  # a candidate's first batches, untimed (the warm-up's, the pipeline filling)
    TIE = 0.02
    GIVE_UP = 200  # batches without one made under the candidate's share (a folder of PNGs, say): skip it
    SPLITS = 2  # splits tried at most, after the workers alone
    MARGIN = 0.95  # of the share the workers' times say they can make in a step: room for their pace's swings
    LEAST = 0.05  # a smaller share for the GPU, or a smaller change of it, is not tried (within the noise)

    def __init__(self, splits: tuple[SharedDecode, SharedDecode], start_after: int = 0,
                 pace: Callable[[int], float | None] | None = None):
        self.splits = splits
        self.start_after = start_after  # training batches before the trial (the workers alone meanwhile)
        self.pace = pace  # n -> the median own time of the last n steps (StepPace.median_s), None: not known
        self.candidates = [0.0]  # the GPU's shares tried, in this order (the workers alone first)
        self.index, self.waited, self.made, self.seen, self.samples = 0, 0, 0, 0, 0
        self.stamps: list[float] = []
        self.held: list[float] = []  # the prefetch thread's seconds for each timed batch
        self.work_from: torch.Tensor | None = None
        # (a batch, the steps, the workers, the prefetch thread), seconds; None: no batch made under that share
        self.results: list[tuple[float, float, float, float] | None] = []
        self.done = False
        for split in splits:
            split.share_with_workers()
            split.gpu_share = 0.0
        splits[0].trial = self  # (the loader times the training split's batches for it: `timed`)

    def timed(self, after: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """`after` (the recipe's on_after_batch_transfer of a training (batch, indices) pair, on the prefetch
        thread: launcher/data/loader.py) timed for the trial while it runs: each batch's samples (its
        indices), those left to the GPU decoder (the batch's LeftToGpu) and the seconds it held the thread."""

        def timed_after(item: Any) -> Any:
            if self.done:
                return after(item)
            gpu = sum(leaf.gpu_samples() for leaf in tree_leaves(item[0]) if isinstance(leaf, LeftToGpu))
            began = time.perf_counter()
            out = after(item)
            self.batch(len(item[1]), gpu, time.perf_counter() - began)
            return out

        return timed_after

    @staticmethod
    def said(share: float) -> str:
        return "the workers alone" if share == 0.0 else f"{round(100 * share)}% on the GPU"

    def batch(self, samples: int, gpu_samples: int, held_s: float = 0.0) -> None:
        """A training batch of `samples` went through the prefetch thread (one thread:
        launcher/data/prefetch.py), which on_after_batch_transfer held for `held_s`; `gpu_samples` of them
        were for the GPU decoder."""
        if self.done:
            return
        self.seen += 1
        if self.seen <= self.start_after:
            return
        share = self.candidates[self.index]
        if (gpu_samples > 0) != (share > 0):  # (still one of the last candidate's batches)
            self.waited += 1
            if self.waited >= self.GIVE_UP:
                self._next(None)
            return
        self.made += 1
        if self.made <= self.SETTLE:
            return
        self.stamps.append(time.perf_counter())
        if len(self.stamps) == 1:
            self.work_from, self.samples, self.held = self.splits[0].work(), 0, []
            return
        self.samples += samples
        self.held.append(held_s)
        if len(self.stamps) > self.MEASURE:
            steps = self.pace(self.MEASURE) if self.pace is not None else None
            if steps is None:
                steps = statistics.median(b - a for a, b in zip(self.stamps[:-1], self.stamps[1:], strict=True))
            workers = self._workers_per_batch(self.samples / self.MEASURE)
            thread = statistics.median(self.held)
            self._next((max(steps, workers, thread), steps, workers, thread))

    def _workers_per_batch(self, samples: float) -> float:
        """Seconds the workers need for a batch of `samples`, at the rate each made its samples since timing
        began (all working at once); 0 where none made any."""
        work = self.splits[0].work()
        if work is None or self.work_from is None:
            return 0.0
        made, spent = (work - self.work_from).unbind(1)
        busy = (made > 0) & (spent > 0)
        rate = float((made[busy] / spent[busy]).sum())
        return samples / rate if rate > 0 else 0.0

    def following(self) -> float | None:
        """The GPU's share to try next, from the last candidate's times; None: none (the trial ends). The
        workers' time for a batch is taken as proportional to their share of it (the share they can make
        in a step's time is theirs now x steps / workers), and so is the prefetch thread's under a split
        (the GPU decoder's). Where no share keeps both within a step, the one where they take as long."""
        if len(self.candidates) > self.SPLITS or self.results[-1] is None:
            return None  # (None: no batch was made under that share, a folder the GPU decoder cannot take)
        share, (_, steps, workers, thread) = self.candidates[-1], self.results[-1]
        if share == 0.0:
            steps = max(steps, thread)  # (the thread's own work without decoding: a floor for any split)
            if workers <= steps * (1 + self.TIE):
                return None  # the workers alone keep up: nothing for the GPU to add
        if workers <= 0.0:
            return None
        gpu = min(1.0, max(0.0, 1.0 - (1.0 - share) * steps / workers * self.MARGIN))
        whole_decoder = thread / share if 0.0 < share < 1.0 else 0.0  # (the decoder's time for a whole batch)
        if gpu * whole_decoder > steps:  # (the decoder would hold the prefetch thread past a step)
            whole_workers = workers / (1.0 - share)
            gpu = whole_workers / (whole_workers + whole_decoder)
        if gpu < self.LEAST or any(abs(gpu - tried) < self.LEAST for tried in self.candidates):
            return None
        return round(gpu, 2)

    def _next(self, figures: tuple[float, float, float] | None) -> None:
        self.results.append(figures)
        self.index, self.waited, self.made, self.stamps = self.index + 1, 0, 0, []
        share = self.following()
        if share is not None:
            self.candidates.append(share)
            self.splits[0].gpu_share = share
            return
        self.done = True
        timed = [(f[0], k) for k, f in enumerate(self.results) if f is not None]
        if not timed:
            return
        best = min(timed)[1]
        if self.results[0] is not None and self.results[0][0] <= self.results[best][0] * (1 + self.TIE):
            best = 0  # (the workers alone win a tie)
        for split in self.splits:
            split.gpu_share = self.candidates[best]
        figures = ", ".join(
            f"{self.said(self.candidates[k])} {1000 * t:.1f} ms (steps {1000 * self.results[k][1]:.1f}, workers "
            f"{1000 * self.results[k][2]:.1f}, prefetch thread {1000 * self.results[k][3]:.1f})" for t, k in timed)
        log.info("data.decode=auto: kept %s (a training batch every, over %d batches after the first %d: %s); "
                 "data.decode=cpu or gpu picks one", self.said(self.candidates[best]), self.MEASURE, self.SETTLE,
                 figures)

