"""The live progress bar on rank 0: epoch, step, loss, img/s, ETA of the run and GPU memory.

`progress=auto` (default) shows it when rank 0's stdout is a terminal, and keeps plain
line-per-epoch logs otherwise (CI, SLURM logs, pipes); `progress=bar` / `progress=lines` force
either. The bar is tqdm, on stdout, cleared at the end of each epoch, where the epoch's line is
logged as usual. It reads nothing from the GPU that would make the host wait: the loss shown is the
last finished epoch's (per-step losses stay on the device), img/s is the host's issue rate, and the
memory figure is the allocator's own count.
"""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch

REFRESH_S = 0.5  # the bar's figures are recomputed at most this often
DRAW_S = 0.1  # and the line redrawn at most this often
BAR_MIN = 10  # narrower than this, the bar itself is left out (the figures matter more)


def wanted(mode: str, is_main: bool) -> bool:
    if not is_main or mode == "lines":
        return False
    return mode == "bar" or sys.stdout.isatty()


class EpochBar:
    """Wraps an epoch's batches; `None`-safe no-op when the bar is off."""

    def __init__(self, enabled: bool, device: torch.device, epochs: int, unit: str = "img"):
        self.enabled = enabled
        self.unit = unit  # what `batch_size` counts: img or tokens
        self.device = device
        self.epochs = epochs
        self.last_loss: float | None = None
        self.epoch_seconds: list[float] = []

    def wrap(self, batches: Iterable, epoch: int, steps: int, batch_size: int) -> Iterator[Any]:
        if not self.enabled:
            yield from batches
            return
        import threading

        from tqdm import tqdm
        from tqdm.contrib.logging import logging_redirect_tqdm

        # A thread lock, not tqdm's default multiprocessing one: a semaphore of a worker that is stopped
        # outright would be reported "leaked" by the resource tracker after the shell prompt.
        tqdm.set_lock(threading.RLock())
        # On stdout, where the epoch lines go: rank 0's stdout is the launcher's terminal itself.
        bar = tqdm(total=steps, leave=False, dynamic_ncols=False, file=sys.stdout, mininterval=DRAW_S)
        self._fit(bar, epoch, 0, steps, batch_size, 0.0)
        bar.refresh()  # (drawn at creation with tqdm's own format)
        started = time.perf_counter()
        last_refresh = started - REFRESH_S  # the figures after the first step, then every REFRESH_S
        # Lines logged while the bar is up (the start-up timeline, warnings) print above it, not into it.
        with logging_redirect_tqdm():
            try:
                for step, batch in enumerate(batches):
                    yield batch
                    now = time.perf_counter()
                    if now - last_refresh >= REFRESH_S:
                        last_refresh = now
                        self._fit(bar, epoch, step + 1, steps, batch_size, now - started)
                    bar.update(1)
            finally:
                bar.close()
                self.epoch_seconds.append(time.perf_counter() - started)

    def _fit(self, bar: Any, epoch: int, done: int, steps: int, batch_size: int, elapsed: float) -> None:
        """The bar's line for this terminal's width, now (it may have been resized): what matters most
        first (epoch and step, img/s, the run's ETA, loss, GPU memory), then the bar in what is left. A
        line never reaches the last column, so it never wraps (a wrapped line cannot be redrawn)."""
        bar.ncols = width = max(20, shutil.get_terminal_size((80, 24)).columns - 1)
        line = f"epoch {epoch + 1}/{self.epochs} step {{n}}/{steps}"
        room = width - len(line) + len("{n}") - len(str(steps))
        fields = []
        for part in self._parts(epoch, done, steps, batch_size, elapsed):
            if len(part) + 2 <= room:
                fields.append(part)
                room -= len(part) + 2
        tail = "".join(f"  {f}" for f in fields)
        bar.bar_format = line + (" {bar}" if room >= BAR_MIN + 1 else "") + tail

    def _parts(self, epoch: int, done: int, steps: int, batch_size: int, elapsed: float) -> list[str]:
        parts = []
        if done:
            parts.append(f"{done * batch_size / max(elapsed, 1e-9):,.0f} {self.unit}/s")
        if self.epoch_seconds:
            per_epoch = sum(self.epoch_seconds) / len(self.epoch_seconds)
        else:
            per_epoch = elapsed * steps / done if done else None
        if per_epoch is not None:
            left = per_epoch * (steps - done) / steps + per_epoch * (self.epochs - epoch - 1)
            parts.append(f"run ETA {_clock(left)}")
        if self.last_loss is not None:
            parts.append(f"loss {self.last_loss:.4f}")
        if self.device.type == "cuda":
            parts.append(f"GPU {torch.cuda.memory_allocated(self.device) / 2**30:.1f} GiB")
        return parts

    def epoch_done(self, row: dict[str, Any]) -> None:
        self.last_loss = row.get("loss")


def _clock(seconds: float) -> str:
    seconds = int(max(0, seconds))
    minutes, s = divmod(seconds, 60)
    hours, m = divmod(minutes, 60)
    return f"{hours}h{m:02d}m" if hours else f"{m}m{s:02d}s"
