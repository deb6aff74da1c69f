"""The garbage collector's frozen set, as the run uses it: what a rank freezes (gc.freeze) while it runs, and
the one collection at its end that frees the run.

A rank freezes what lives at two points: after compiling (train/compiling.py's settle_heap: no full
collection walks the compiled code's objects again) and before a DataLoader forks its workers
(data/loader.py: a forked worker's collector never frees what it inherited). At the run's end, `release`
collects the run's garbage, after unfreezing if this process froze anything during the run. The count is
kept here rather than read back with gc.get_freeze_count(), which walks the whole frozen set (a
forkserver's imports: about a third of a million objects) each time it is called."""

from __future__ import annotations

import gc

_frozen_by_run = 0


def freeze() -> None:
    """Collect the garbage, then freeze what lives."""
    global _frozen_by_run
    gc.collect()
    gc.freeze()
    _frozen_by_run += 1


def release() -> None:
    """At the run's end, before teardown: collect the run's garbage, after undoing what `freeze` froze during
    the run, if it froze anything. The trainer sits in reference cycles (its step's closures, a recipe's
    loader), so `trainer = None` alone frees it only when a collection reaches it, and none reaches frozen
    objects: a compiled, captured ddp run on 2x H200 kept its CUDA graph, with NCCL's all-reduce in it,
    alive into destroy_process_group and blocked there forever after its last epoch. What the forkserver froze
    before the fork (train/preload.py) holds no part of the run: it stays frozen unless the run froze too
    (gc.unfreeze undoes every freeze at once), so that a run that froze nothing walks only its own objects."""
    global _frozen_by_run
    if _frozen_by_run:
        gc.unfreeze()
        _frozen_by_run = 0
    gc.collect()
