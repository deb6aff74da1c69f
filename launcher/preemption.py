"""Preemption and time limits under `backend=slurm`: finish the epoch, checkpoint, requeue, resume.

SLURM warns a job with SIGUSR2 before killing it (submitit asks for `--signal=USR2@90`: 90 s before
the time limit; a preemption or `scancel --signal=USR2` sends it at once). Every training process
notes the signal; at the end of the epoch the ranks agree (the flag rides on the epoch's metric
all-reduce), rank 0 writes the epoch's checkpoint, asks SLURM to requeue the job and every process
exits. The requeued job runs the same tasks again (SLURM_RESTART_COUNT > 0): they continue the same
run dir from its last checkpoint, so each epoch is trained once, and a run that had already finished
is not run again. Without the signal (`scontrol requeue`, a node failure) the job still resumes from
its last end-of-epoch checkpoint.

The grace period must cover the rest of an epoch; for long epochs raise `--signal`'s delay
(`+backend.additional.signal=USR2@300`).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
from pathlib import Path

PREEMPTED_EXIT = 75  # EX_TEMPFAIL: "try again later", which is what a requeued job does
MARKER = "preempted"  # in the run dir: SLURM_RESTART_COUNT of the run that was preempted
ENABLE_ENV = "LAUNCH_SLURM_REQUEUE"  # set by the SLURM task (launcher/slurm.py)
MAX_ENV = "LAUNCH_MAX_REQUEUES"

log = logging.getLogger("launcher.preemption")


class Preempted(Exception):
    """Raised on every rank after the checkpoint is written and the job requeued."""


def enabled() -> bool:
    return os.environ.get(ENABLE_ENV) == "1" and "SLURM_JOB_ID" in os.environ


def restart_count() -> int:
    """How many times SLURM has requeued this job (0 for its first run)."""
    try:
        return int(os.environ.get("SLURM_RESTART_COUNT", "0"))
    except ValueError:
        return 0


def requeued() -> bool:
    """This is a SLURM job run again after a requeue: it continues its own run dir from its checkpoint."""
    return enabled() and restart_count() > 0


def was_preempted(run_dir: Path) -> bool:
    """True in the job run that asked for its own requeue (the marker names that run)."""
    marker = Path(run_dir) / MARKER
    return marker.exists() and marker.read_text().strip() == str(restart_count())


class PreemptionWatch:
    """Notes SIGUSR2 (when `active`); `requested` is read between epochs."""

    def __init__(self, active: bool):
        self.requested = False
        self._previous = signal.signal(signal.SIGUSR2, self._note) if active else None

    def _note(self, signum, frame) -> None:
        self.requested = True

    def close(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGUSR2, self._previous)
            self._previous = None


def may_requeue(warn: bool = True) -> bool:
    """Whether this job may be requeued once more (every rank decides alike; `warn` on one of them)."""
    limit = int(os.environ.get(MAX_ENV, "3"))
    if restart_count() >= limit:
        if warn:
            log.warning("SIGUSR2 received, but this job was requeued %d times already (backend.max_requeues=%d): "
                        "training goes on until SLURM stops it; resume later from the last checkpoint",
                        restart_count(), limit)
        return False
    return True


def requeue(run_dir: Path) -> None:
    """Ask SLURM to run this job again (rank 0, after the checkpoint is on disk)."""
    (Path(run_dir) / MARKER).write_text(f"{restart_count()}\n")
    job_id = os.environ["SLURM_JOB_ID"]
    subprocess.run(["scontrol", "requeue", job_id], check=True, capture_output=True, text=True)
