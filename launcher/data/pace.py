"""The training steps' own times, kept for what tunes the input to the step's pace while training runs.

The loop's StepClock (launcher/train/stall.py) marks each training step's "ready" (its batch there) and
its end on the device's clock; each step's own time between the two (the step's work, input waits left
out) goes here, for a data path to read: a Dataset's DecodeTrial (data.decode=auto: decode_trial.py)
times its candidates by it, fed by the loader (loader.py), never through the recipe.
"""

from __future__ import annotations

import statistics
import threading
from collections import deque

import torch


class StepPace:
    """The last training steps' own times, each from its "ready" mark to its end on the device's clock
    (StepClock's events: the step's kernels, its collectives and the host's issuing of them, without the
    wait for its batch), read from any thread without waiting for the device: only steps the device has
    finished count. Under ddp a step's own time includes waiting at its all-reduce for a slower rank."""

    def __init__(self, keep: int = 64):
        self._steps: deque[tuple[object, object]] = deque(maxlen=keep)
        self._lock = threading.Lock()

    def add(self, ready: object, end: object) -> None:
        with self._lock:
            self._steps.append((ready, end))

    def median_s(self, n: int) -> float | None:
        """The median own time of the last `n` finished steps, in seconds; None while fewer have finished."""
        with self._lock:
            steps = list(self._steps)
        done = [(ready, end) for ready, end in steps
                if not isinstance(end, torch.cuda.Event) or end.query()]
        if len(done) < n or n < 1:
            return None
        return statistics.median(ready.elapsed_time(end) / 1000.0 if isinstance(end, torch.cuda.Event)
                                 else end - ready for ready, end in done[-n:])
