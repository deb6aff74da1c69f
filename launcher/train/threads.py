"""Work beside the training thread, and the profiler.

A run's set-up work that the GPU need not wait for runs on threads of its own (`Asides`): TensorBoard's
writer is opened while the run warms up, page-locked memory for the checkpoints in flight is allocated
while the first epoch trains. They are waited for at the first epoch's end (whose checkpoint takes that
memory), and on the way out. `profiled`: torch.profiler over one epoch (profile=true).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("launcher.train")


class Aside:
    """`fn(*args, **kwargs)` on a thread of its own, with `device` (a GPU) as its current device (a new
    thread's is GPU 0: pinned memory allocated there would open a CUDA context on another rank's GPU).
    `wait` joins it and raises what it raised, on the training thread."""

    def __init__(self, device: torch.device | None, fn: Callable[..., Any], *args: Any, **kwargs: Any):
        self.failed: BaseException | None = None

        def work() -> None:
            try:
                if device is not None and device.type == "cuda":
                    torch.cuda.set_device(device)
                fn(*args, **kwargs)
            except BaseException as exc:
                self.failed = exc

        self.thread = threading.Thread(target=work, name=getattr(fn, "__name__", "aside"), daemon=True)
        self.thread.start()

    def wait(self) -> None:
        self.thread.join()
        if self.failed is not None:
            raise self.failed


class Asides:
    """The set-up threads a run started and has not waited for yet."""

    def __init__(self) -> None:
        self._running: list[Aside] = []

    def start(self, device: torch.device | None, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        self._running.append(Aside(device, fn, *args, **kwargs))

    def wait(self, quiet: bool = False) -> None:
        """Wait for every one and raise what one raised (`quiet`: on the way out, where an error of the run
        itself is usually what is being raised)."""
        running, self._running = self._running, []
        for aside in running:
            try:
                aside.wait()
            except Exception:
                if not quiet:
                    raise


@contextlib.contextmanager
def profiled(run_dir: Path) -> Iterator[None]:
    """torch.profiler over one epoch: profile.txt (ops by device time) and trace.json (chrome://tracing)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        yield
    sort = "self_device_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    (run_dir / "profile.txt").write_text(prof.key_averages().table(sort_by=sort, row_limit=40) + "\n")
    prof.export_chrome_trace(str(run_dir / "trace.json"))
    log.info("profile of this epoch: %s (and trace.json for chrome://tracing or Perfetto)", run_dir / "profile.txt")
