"""Probe: every garbage collection of 5 ms or more in any Python process started with this folder on
PYTHONPATH (the launcher, its forkserver and the workers forked from it), appended to
$GC_TRACE_DIR/gc-<pid>.txt as `unix_time generation milliseconds collected`.

    PYTHONPATH=bench/probe/gc_trace:$PYTHONPATH GC_TRACE_DIR=/tmp/gc launch recipe=cifar10_fast ...

GC_NO_FREEZE=1 also makes gc.freeze do nothing (the launcher's heap left unfrozen after compiling, as before
settle_heap in launcher/train/loop.py): an A/B of that change in one call.
"""

import gc
import os
import time

_where = os.environ.get("GC_TRACE_DIR")
_started = [0.0]


def _trace(phase: str, info: dict) -> None:
    if phase == "start":
        _started[0] = time.perf_counter()
        return
    ms = (time.perf_counter() - _started[0]) * 1000
    if ms >= 5:
        with open(os.path.join(_where, f"gc-{os.getpid()}.txt"), "a") as f:
            f.write(f"{time.time():.3f} {info['generation']} {ms:.1f} {info['collected']}\n")


if _where:
    os.makedirs(_where, exist_ok=True)
    gc.callbacks.append(_trace)

if os.environ.get("GC_NO_FREEZE") == "1":
    gc.freeze = lambda: None
