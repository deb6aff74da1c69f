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
import signal
import subprocess
from pathlib import Path

from launcher.files import PREEMPTED
from launcher.spec import RequeuePolicy

log = logging.getLogger("launcher.preemption")


class Preempted(Exception):
    """Raised on every rank after the checkpoint is written and the job requeued."""


class PreemptionWatch:
    """Notes SIGUSR2 in a job that may requeue itself; `requested` is read between epochs."""

    def __init__(self, policy: RequeuePolicy | None):
        self.policy = policy
        self.requested = False
        self._previous = signal.signal(signal.SIGUSR2, self._note) if policy is not None else None

    def _note(self, signum, frame) -> None:
        self.requested = True

    def may_requeue(self, warn: bool = True) -> bool:
        """Whether this job may be requeued once more (every rank decides alike; `warn` on one of them)."""
        policy = self.policy
        if policy is None:
            return False
        if policy.restart_count >= policy.max_requeues:
            if warn:
                log.warning("SIGUSR2 received, but this job was requeued %d times already (backend.max_requeues=%d): "
                            "training goes on until SLURM stops it; resume later from the last checkpoint",
                            policy.restart_count, policy.max_requeues)
            return False
        return True

    def requeue(self, run_dir: Path) -> None:
        """Ask SLURM to run this job again (rank 0, after the checkpoint is on disk)."""
        assert self.policy is not None
        (Path(run_dir) / PREEMPTED).write_text(f"{self.policy.restart_count}\n")
        subprocess.run(["scontrol", "requeue", self.policy.job_id], check=True, capture_output=True, text=True)

    def close(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGUSR2, self._previous)
            self._previous = None
