"""What a run dir holds, by name, and the one way files in it are written: atomically.

Every file that a reader may open while the run goes on (a checkpoint, results, a failure record,
the metrics after a resume) is written to a temporary name beside it and renamed over the old one,
so nobody ever reads half a file and a crash never leaves one.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import IO

# The files of a run dir (README.md "What a run leaves behind").
CONFIG = "config.yaml"  # the resolved config
PLAN = "plan.json"  # strategy, devices, worker environment
LOG = "train.log"  # every line prefixed [launcher] or [rank N]
METRICS = "metrics.jsonl"  # one JSON line per epoch
RESULTS = "results.json"  # the final metrics; a run dir with one holds a finished run
CHECKPOINTS = "checkpoints"
LAST_CHECKPOINT = "last.pt"
FAILURES = "failures"  # one record per failing rank and attempt
TENSORBOARD = "tensorboard"  # TensorBoard event files
CURVES = "curves.png"  # loss and accuracy per epoch
PREEMPTED = "preempted"  # SLURM: the restart count of the job run that asked for its own requeue
SWEEP_OUTPUT = "launch.out"  # a sweep run's console output (local sweeps)
SLURM_RECORD = "slurm.json"
CLAIM = ".launch-claim.json"  # which launch owns the dir: pid, host, start, command (host/rundir.py)


def last_checkpoint(run_dir: str | Path) -> Path:
    return Path(run_dir) / CHECKPOINTS / LAST_CHECKPOINT


def write_atomic(path: Path, write: Callable[[IO[bytes]], None], durable: bool = False) -> None:
    """Call `write(file)` on a temporary file beside `path`, then rename it to `path`.

    durable: fsync before the rename, so the new contents survive a power loss (checkpoints).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text_atomic(path: Path, text: str) -> None:
    write_atomic(path, lambda f: f.write(text.encode()))
