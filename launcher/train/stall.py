"""How long training waited for its input, measured on the compute stream rather than guessed.

Per step, one CUDA event is recorded when the batch is ready for the model (after the prefetcher made
the compute stream wait for its copy, or after the on-device gather) and one after the step's last
kernel. The GPU stamps an event when it reaches it, so the time from the previous step's end to this
step's "ready" is time the compute stream sat idle waiting for the input (or for the host to hand it
work). Summed over the epoch and divided by the epoch's span, that is the input-stall fraction.
On a CPU device the same marks are taken with the host clock.

The same two marks give each training step's own time (its "ready" to its end: the step's work, input
waits left out), which go to the data's `StepPace` (launcher/data/pace.py) where the data path reads
them (a Dataset's DecodeTrial: data.decode=auto).

What held an epoch up is said once per run, with the setting that would help: its input (`input_advice`),
or on the CPU, a machine busier than its cores while each process ran several threads (`thread_advice`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from launcher.data.pace import StepPace
from launcher.errors import ExplainedStop

INPUT_BOUND = 0.10  # above this fraction of the epoch, the log calls the run input-bound
# A machine is busy when its load average is at least this many cores' worth of work above the cores a CPU
# run may use (its own threads fill those)
BUSY_LOAD = 1.0


@dataclass
class EpochTiming:
    span_s: float  # first mark to the last step's end, on the device's own clock
    input_wait_s: float

    @property
    def stall_fraction(self) -> float:
        return self.input_wait_s / self.span_s if self.span_s > 0 else 0.0


class DeviceTimeout(ExplainedStop):
    """The device did not finish an epoch's work in time (a peer stuck inside a captured collective)."""


def wait_for(event, timeout_s: float | None, what: str) -> None:
    """event.synchronize(), but giving up after `timeout_s` with a DeviceTimeout.

    With perf.cuda_graph the gradient all-reduces run inside the replayed graph, where NCCL's
    watchdog cannot see them; if a peer hangs, this is where its partner would otherwise wait forever.
    """
    if timeout_s is None:
        event.synchronize()
        return
    deadline = time.monotonic() + timeout_s
    pause = 1e-4
    while not event.query():
        if time.monotonic() > deadline:
            raise DeviceTimeout(f"{what} did not finish within {timeout_s:g}s (strategy.timeout_s): another rank "
                                "is probably stuck or gone")
        time.sleep(pause)
        pause = min(pause * 2, 0.01)


class StepClock:
    def __init__(self, device: torch.device, timeout_s: float | None = None, pace: StepPace | None = None):
        self.cuda = device.type == "cuda"
        self.device = device
        self.timeout_s = timeout_s
        self.pace = pace  # (training epochs': each step's own time also goes there)
        self._marks: list[tuple[str, object]] = []

    def _mark(self, kind: str) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(self.device))
            self._marks.append((kind, event))
        else:
            self._marks.append((kind, time.perf_counter()))

    def start(self) -> None:
        self._marks = []
        self._mark("end")  # the span starts as if a step had just ended: the first batch's wait counts

    def batch_ready(self) -> None:
        self._mark("ready")

    def step_end(self) -> None:
        self._mark("end")
        if self.pace is not None and len(self._marks) > 1 and self._marks[-2][0] == "ready":
            self.pace.add(self._marks[-2][1], self._marks[-1][1])

    def _seconds(self, a, b) -> float:
        if self.cuda:
            return a.elapsed_time(b) / 1000.0
        return b - a

    def finish(self) -> EpochTiming:
        """Waits for the device, then sums the waits. Call once per epoch, not per step."""
        if self.cuda:
            wait_for(self._marks[-1][1], self.timeout_s, "the GPU's work of this epoch")
        wait = 0.0
        last_end = None
        for kind, stamp in self._marks:
            if kind == "end":
                last_end = stamp
            elif last_end is not None:
                wait += self._seconds(last_end, stamp)
                last_end = None
        span = self._seconds(self._marks[0][1], self._marks[-1][1]) if len(self._marks) > 1 else 0.0
        return EpochTiming(span, wait)


class Readback:
    """Device values the host reads later without making the device wait: stacked and copied into pinned
    host memory behind the work that produced them (stream order), read once the device is past it.

    The epoch's sums are read this way while the next epoch's first steps are already queued
    (launcher/train/loop.py), so the GPU does not idle while the host reads, logs and checkpoints."""

    def __init__(self, values: list[torch.Tensor], device: torch.device):
        stacked = torch.stack([v.detach().to(torch.float64) for v in values])
        self.event = None
        if device.type == "cuda":
            self.host = torch.empty(stacked.shape, dtype=torch.float64, pin_memory=True)
            self.host.copy_(stacked, non_blocking=True)
            self.event = torch.cuda.current_stream(device).record_event()
        else:
            self.host = stacked

    def values(self, timeout_s: float | None = None) -> list[float]:
        """The values, once the device has produced them (waiting at most `timeout_s`: `wait_for`)."""
        if self.event is not None:
            wait_for(self.event, timeout_s, "the GPU's work of this epoch")
        return self.host.tolist()


def input_advice(fraction: float, placement: str, data_mb: float, compiled: bool) -> str | None:
    """One line for the log when an epoch was input-bound, naming the setting that would help."""
    if fraction <= INPUT_BOUND:
        return None
    share = f"training waited for input {100 * fraction:.0f}% of the epoch"
    if placement == "workers":  # (a recipe's Datasets, through DataLoader workers)
        return (f"input-bound: {share}: the DataLoader workers do not keep up; raise data.workers (if cores are "
                "free) or data.worker_prefetch, make the Dataset's __getitem__ cheaper, or move decoding and "
                "cropping to the GPU (recipe.on_after_batch_transfer; recipe=imagefolder: data.decode=gpu)")
    if placement == "host":
        return (f"input-bound: {share}; data.placement=gpu keeps the {data_mb:,.0f} MB dataset on the GPU, "
                "or raise data.prefetch_depth")
    if not compiled:
        return (f"input-bound: {share} with the data already on the GPU, so the host is too slow to issue "
                "the steps: try perf.compile=true or a larger batch_size")
    return f"input-bound: {share} with the data on the GPU: a larger batch_size gives the GPU more work per step"


def thread_advice(threads: int, processes: int, cores: int, load: float, chosen: bool) -> str | None:
    """One line for the log when a CPU run's epochs ran on a busy machine (its load average `load` at least
    BUSY_LOAD above the `cores` the run may use) with `threads` torch threads in each of its `processes`
    processes on this machine: the thread count, where it came from (`chosen` by launch, else the user's
    OMP_NUM_THREADS), and how to change it. A parallel operation waits for its slowest thread, and a thread
    waiting for a core that other work holds holds up every operation, so fewer threads can run much faster
    there."""
    if threads <= 1 or load < cores + BUSY_LOAD:
        return None
    where = (f"launch's choice: the {cores} cores this run may use over its {processes} process"
             f"{'es' if processes != 1 else ''}" if chosen else "OMP_NUM_THREADS as set where launch ran")
    return (f"slow epochs? this machine is busy (load {load:.1f} on the {cores} cores this run may use) and each "
            f"process trained with {threads} threads (OMP_NUM_THREADS={threads}, {where}); a thread waiting for a "
            f"core holds up every operation: try OMP_NUM_THREADS=1 launch ... (or another count below {threads})")
