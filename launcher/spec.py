"""What travels from the launcher to each worker process: one picklable WorkerSpec.

Everything a worker needs is in it (the typed, frozen config; the strategy the plan chose; the run
dir; where to resume from), so workers never compose a Hydra config and nothing reaches them through
environment variables of the launcher's own (`env` holds only what torch and the CUDA runtime read:
CUDA_VISIBLE_DEVICES and the thread count, applied before CUDA starts). The torch.distributed contract
(RANK, WORLD_SIZE, MASTER_ADDR...) stays what torchelastic, torchrun or srun set.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from launcher.config import Config
    from launcher.strategies import Strategy


PREEMPTED_EXIT = 75  # EX_TEMPFAIL, "try again later": a worker that checkpointed and requeued its SLURM job


@dataclass(frozen=True)
class RequeuePolicy:
    """A SLURM job that may requeue itself on SIGUSR2 (launcher/train/preemption.py)."""

    job_id: str
    restart_count: int  # SLURM_RESTART_COUNT of this run of the job: >0 after a requeue
    max_requeues: int

    @property
    def requeued(self) -> bool:
        """This is the job run again after a requeue: it continues its own run dir from its checkpoint."""
        return self.restart_count > 0


@dataclass(frozen=True)
class WorkerSpec:
    config: Config  # typed and frozen
    strategy: Strategy  # chosen once by the plan; the worker asks it, never the strategy's name
    run_dir: str
    env: dict[str, str] = field(default_factory=dict)  # applied in the worker before CUDA can start
    device_index: int | None = None  # the worker's GPU among those visible to it; None: its local rank
    resume_from: str | None = None  # a checkpoint file (the `resume` key, resolved)
    evaluate: str | None = None  # a checkpoint file to evaluate instead of training (`launch eval`)
    evaluate_read: str | None = None  # where the workers read it: hard links that a live run cannot replace
    requeue: RequeuePolicy | None = None  # SLURM jobs that requeue on preemption
    started_at: float = 0.0  # the launcher's time.time() when the command started (time to first step)
    spawned_s: float | None = None  # seconds after started_at when the launcher started the workers
    typed: tuple[str, ...] = ()  # the config keys the command line set (`recipe` for recipe=text): named first
    #                              where the nodes of a launch over several machines were given different ones
