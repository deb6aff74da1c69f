"""An epoch's end: queued on the device behind its steps, read a few steps into the next epoch, and its verdict.

The host queues the end (`EpochEnds.queue`: buffers averaged, the evaluation, the sums and rank 0's checkpoint
copied to host memory) without waiting for the device and starts the next epoch; the end is held
(`DeferredEnd`) until OVERLAP_S of device time into it, where it is read (`EpochEnds.conclude`: the figures
agreed by every rank, the row reported, logged and checkpointed) while the GPU runs those steps. On the CPU,
where nothing runs ahead of the host, it is read before the next epoch's clock starts.

Reading an end gives a `Verdict` the loop acts on: go on, stop (a NaN loss: the epoch is not recorded and the
last checkpoint is the last good state; a preemption: the job is requeued; early stopping), or compile now
(perf.compile=auto, after the first epoch). The loop acts before the next step, so a NaN or a preemption found
while the next epoch runs stops the run before anything of that epoch is saved. The last epoch, a compile
decision, early stopping (its decision comes before the next epoch changes the weights) and a strategy whose
epoch ends do not overlap read each end at once.
"""

from __future__ import annotations

import enum
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from launcher.config import Precision
from launcher.figures import check_report
from launcher.train import checkpoint, results, stops
from launcher.train.early_stop import EarlyStop
from launcher.train.preemption import Preempted
from launcher.train.stall import Readback, StepClock, input_advice, thread_advice
from launcher.train.step import Figures
from launcher.world import available_cores

if TYPE_CHECKING:
    from pathlib import Path

    from launcher.config import Config
    from launcher.data.placement import Data
    from launcher.figures import NamedFigures
    from launcher.recipes import Recipe
    from launcher.strategies import Strategy
    from launcher.train.compiling import Decision
    from launcher.train.evaluation import Evaluation, QueuedEvaluation
    from launcher.train.metrics import MetricsLog
    from launcher.train.preemption import PreemptionWatch
    from launcher.train.progress import EpochBar
    from launcher.train.reporting import TensorBoardLog
    from launcher.train.saving import Saves
    from launcher.train.step import TrainStep
    from launcher.train.threads import Asides
    from launcher.train.trackers import Trackers

log = logging.getLogger("launcher.train")

# On GPUs an epoch's figures are read (and it is logged and checkpointed) a few steps into the next epoch,
# with those steps queued for the device to run meanwhile: enough steps for OVERLAP_S of device time by the
# last epoch's pace (OVERLAP_STEPS before any epoch was read).
OVERLAP_S = 0.05
OVERLAP_STEPS = 4


class Next(enum.Enum):
    """What the loop does after an epoch's end."""

    GO_ON = "go on"
    NAN = "stop: the training loss became NaN or infinite"
    PREEMPTED = "stop: SIGUSR2 (preemption or time limit), the job requeued"
    EARLY = "stop early (early_stop)"
    COMPILE = "compile now (perf.compile=auto), then go on"


@dataclass(frozen=True)
class Verdict:
    """An epoch's end's conclusion (`EpochEnds.conclude`), the same on every rank (read from agreed figures)."""

    next: Next
    epoch: int  # the epoch whose end it is (from 0)
    epoch_s: float = 0.0  # the epoch's span, the slowest rank's (what perf.compile=auto weighs)
    loss: float = 0.0  # Next.NAN: the epoch's loss
    bad_step: int = 0  # Next.NAN: the global step whose loss was the first that was not finite

    @property
    def stops(self) -> bool:
        return self.next in (Next.NAN, Next.PREEMPTED, Next.EARLY)


@dataclass
class QueuedEpoch:
    """An epoch whose steps and end are queued on the device and whose figures the host has not read
    yet (`EpochEnds.conclude` reads them while the next epoch's first steps run)."""

    epoch: int
    row: dict[str, Any]  # what the host knew when it queued the epoch's end
    clock: StepClock
    started: float  # perf_counter() when the host began the epoch
    steps: int  # the steps this run took in the epoch (fewer than an epoch's when it resumed inside it)
    names: list[str]  # the training figures' names (the loss first)
    figures: Readback  # finite steps, each training figure's sum and count (, the evaluation's)
    evaluation: QueuedEvaluation | None
    memory_mb: list[float]  # this rank's peak allocated and reserved (-1 without a GPU)
    snapshot: checkpoint.HostSnapshot | None  # rank 0: the state after the epoch, being copied to host memory
    compiled: Decision  # perf.compile's decision while the epoch ran (pending: its time decides it)
    skipped: int = 0  # training samples this rank's Dataset skipped in the epoch
    first: int = 0  # the step of the epoch it started at
    snapshot_s: float = 0.0  # rank 0's host time queuing the snapshot's copies


class DeferredEnd:
    """The epoch whose end is queued on the device and not read yet: held from the end of its steps to step
    `at` of the next epoch (`place`), where `read_if_due` hands it to `conclude` (EpochEnds.conclude) while
    the GPU runs those steps; or read at once (`read_now`)."""

    def __init__(self, conclude: Callable[[QueuedEpoch, float | None], Verdict]):
        self._conclude = conclude
        self._held: QueuedEpoch | None = None
        self.at = 0

    @property
    def held(self) -> bool:
        return self._held is not None

    def hold(self, queued: QueuedEpoch) -> None:
        self._held = queued

    def read_now(self, queued: QueuedEpoch) -> Verdict:
        return self._conclude(queued, None)

    def place(self, steps: int, step_s: float | None, gpu: bool) -> None:
        """Where, in an epoch of `steps` steps, the epoch before is read: the same step on every rank (its
        reading is a collective; `step_s`, the last epoch's seconds a step, is agreed by every rank); on the
        CPU, where nothing runs ahead of the host, before the epoch's clock starts."""
        self.at = 0
        if gpu:
            cover = OVERLAP_STEPS if step_s is None else max(1, math.ceil(OVERLAP_S / step_s))
            self.at = min(cover, steps - 1)

    def read_if_due(self, step: int, next_started: float) -> Verdict | None:
        """At step `step` of the next epoch (begun at `next_started`): the held end's verdict, where this is
        its step; else None."""
        if self._held is not None and step == self.at:
            queued, self._held = self._held, None
            return self._conclude(queued, next_started)
        return None


@dataclass
class Reporters:
    """Where rank 0 sends each epoch's row."""

    metrics_log: MetricsLog  # metrics.jsonl
    tensorboard: TensorBoardLog
    trackers: Trackers  # log=[mlflow,csv,wandb]
    bar: EpochBar  # the progress bar (or lines)

    def epoch(self, row: dict[str, Any]) -> None:
        self.metrics_log.append(row)
        self.tensorboard.epoch(row)
        self.trackers.epoch(row)
        self.bar.epoch_done(row)


class EpochEnds:
    """What every epoch's end does (`queue`, then `conclude`), and what it keeps over the run: the finished
    epochs' rows (`history`), the last epoch's pace (`step_s`), and why the run stopped early."""

    def __init__(self, cfg: Config, strategy: Strategy, device: torch.device, step: TrainStep, data: Data,
                 recipe: Recipe, evaluation: Evaluation, named_figures: NamedFigures, saves: Saves,
                 reporters: Reporters, preemption: PreemptionWatch, asides: Asides, timings: results.Timings,
                 history: list[dict[str, Any]], env: dict[str, str], run_dir: Path, steps_per_epoch: int):
        self.cfg, self.strategy, self.device, self.step, self.data = cfg, strategy, device, step, data
        self.recipe, self.evaluation, self.named_figures = recipe, evaluation, named_figures
        self.saves, self.reporters, self.preemption, self.asides = saves, reporters, preemption, asides
        self.timings, self.env, self.run_dir, self.steps_per_epoch = timings, env, run_dir, steps_per_epoch
        self.is_main = strategy.is_main
        self.fp16 = cfg.perf.precision is Precision.fp16
        self.history = history  # every finished epoch's row
        self.early_stop = EarlyStop.from_config(cfg)  # early_stop.metric: None when not asked
        self.stopped_early: dict[str, Any] | None = None  # why the run stopped before its last epoch
        self.step_s: float | None = None  # the last epoch's seconds per step (the slowest rank's)
        self.advised = False  # the input-bound advice was logged (once per run)

    def queue(self, epoch: int, row: dict[str, Any], clock: StepClock, started: float, steps: int, skipped: int,
              first: int, compiled: Decision, warmed: bool) -> QueuedEpoch:
        """The epoch's end as device work, queued behind its steps without waiting for them: buffers
        averaged, the evaluation (`warmed`: the run compiles or captures, so the first one warms up first),
        the sums and (rank 0) the checkpoint's tensors copied to host memory."""
        setup_start = time.perf_counter()
        self.asides.wait()  # (TensorBoard's writer; the pinned memory the snapshot below takes)
        if self.cfg.saves:  # (the first epoch's end: what the checkpoints' memory, made beside it, still held)
            row["checkpoint_wait_s"] = round(time.perf_counter() - setup_start, 4)
        nets = self.step.nets
        self.strategy.average_buffers(nets.module)
        evaluation = self.evaluation.queue(nets, self.data, warmed) if self.evaluation.after(epoch) else None
        sums = self.step.sums
        figures = [sums.finite_steps, sums.overflowed, *sums.figures.tensors()]
        if evaluation is not None:
            figures += evaluation.figures.tensors()
        row["lr"] = self.step.steppers[0].scheduler.get_last_lr()[0]
        snapshot_start = time.perf_counter()
        snapshot = self.saves.snapshot()
        return QueuedEpoch(epoch, row, clock, started, steps, sums.figures.names, Readback(figures, self.device),
                           evaluation, self._local_memory_mb(), snapshot, compiled, skipped, first,
                           time.perf_counter() - snapshot_start if snapshot is not None else 0.0)

    def conclude(self, queued: QueuedEpoch, next_started: float | None = None) -> Verdict:
        """Read a queued epoch's figures (agreed by every rank); a NaN loss stops the run here, the epoch
        unrecorded; else record, log and checkpoint it, and say whether to stop (early, or for a preemption)
        or compile before the next epoch. `next_started`: when the next epoch began (None: not yet)."""
        cfg, strategy, row, epoch = self.cfg, self.strategy, queued.row, queued.epoch
        local = queued.figures.values(strategy.collective_timeout())
        timing = queued.clock.finish()
        steps = queued.steps
        finite_steps, overflowed, sums = local[0], local[1], local[2:]
        trained = 2 * len(queued.names)
        # Sums and counts add up over the ranks (each figure exact over every rank's samples). The
        # preemption flag rides along, so every rank learns of a SIGUSR2 that reached any of them.
        eval_skipped = float(queued.evaluation.skipped) if queued.evaluation is not None else 0.0
        *sums, stop, skipped, eval_skipped = strategy.reduce_host(
            [*sums, float(self.preemption.requested), float(queued.skipped), eval_skipped])
        train = Figures.means(queued.names, sums[:trained])
        # The slowest rank sets the pace: its span and its input wait. The rank with the most
        # non-finite steps rides along, as it hit the first one earliest.
        span_s, stall, non_finite, alloc_mb, reserved_mb = strategy.reduce_host(
            [timing.span_s, timing.stall_fraction, steps - finite_steps, *queued.memory_mb], op="max")
        row["loss"] = train.pop("loss")
        row.update({f"train_{name}": value for name, value in train.items()})
        row.update({"train_s": span_s, f"{self.data.unit}_per_s":
                    steps * cfg.batch_size * self.data.targets_per_sample / span_s, "input_stall": round(stall, 4)})
        if skipped:
            row["skipped"] = int(skipped)
        if eval_skipped:
            row["eval_skipped"] = int(eval_skipped)
        if self.fp16:  # (every rank skips the same steps: their gradients were averaged first)
            row["overflow_steps"] = int(overflowed)
        if non_finite > 0:
            return Verdict(Next.NAN, epoch, span_s, row["loss"],
                           epoch * self.steps_per_epoch + queued.first + steps - int(non_finite))
        if queued.evaluation is not None:
            eval_s = queued.evaluation.clock.finish().span_s
            row.update({f"test_{k}": v for k, v in Figures.means(queued.evaluation.figures.names,
                                                                 sums[trained:]).items()})
            row["eval_s"] = eval_s
            self.timings.eval_s += eval_s
        self.timings.train_s += span_s
        self.step_s = span_s / steps
        if alloc_mb >= 0:
            row["max_mem_allocated_mb"], row["max_mem_reserved_mb"] = round(alloc_mb, 1), round(reserved_mb, 1)
        else:
            row["max_mem_allocated_mb"] = row["max_mem_reserved_mb"] = None
        # Wall time from this epoch's start to the next one's (to now when nothing was started after it).
        row["epoch_s"] = (next_started or time.perf_counter()) - queued.started
        self._report(row)
        if queued.snapshot is not None:
            self.saves.make_room(row, queued.snapshot_s)
        self.history.append(row)
        if self.early_stop is not None and epoch + 1 < cfg.epochs:  # (the same on every rank: the rows are)
            self.stopped_early = self.early_stop.judge(self.history)
            if self.stopped_early is not None:
                row["stopped_early"] = self.stopped_early["reason"]
        self.saves.epoch_done(queued.snapshot, row, self.history)
        if self.is_main:
            self.reporters.epoch(row)
            log.info("%s", results.epoch_line(row, cfg.epochs, self.data.unit))
            self.advised = self.advised or self._advise(row, epoch, queued.compiled.compile)
        if self.stopped_early is not None:
            return Verdict(Next.EARLY, epoch, span_s)
        more_to_do = epoch + 1 < cfg.epochs and cfg.saves
        if stop > 0 and more_to_do and self.preemption.may_requeue(warn=self.is_main):
            return Verdict(Next.PREEMPTED, epoch, span_s)
        if queued.compiled.pending and epoch + 1 < cfg.epochs:
            return Verdict(Next.COMPILE, epoch, span_s)
        return Verdict(Next.GO_ON, epoch, span_s)

    def stopping(self, verdict: Verdict) -> BaseException:
        """What the run stops with on a NaN or a preemption, once the last checkpoint is on disk (every rank
        stops at the same epoch: the verdict came from agreed figures). A NaN epoch was not saved, so the
        last checkpoint is the last good state; a preempted run's rank 0 asks SLURM to requeue the job, and
        nobody leaves (and ends the others) before it has."""
        self.saves.writer.wait()
        if verdict.next is Next.NAN:
            return stops.non_finite_loss(self.cfg, self.run_dir, verdict.epoch, verdict.loss, verdict.bad_step,
                                         self.steps_per_epoch)
        if self.is_main:
            log.warning("SIGUSR2 (preemption or time limit): stopping after epoch %d, checkpoint written; the "
                        "job is requeued and resumes from it in this run dir", verdict.epoch + 1)
            self.preemption.requeue(self.run_dir)
        self.strategy.barrier()
        return Preempted()

    def _report(self, row: dict[str, Any]) -> None:
        """The recipe's derived figures added to the epoch's row, on every rank (each has the same figures,
        so early stopping and the best checkpoints watch a derived one alike everywhere), checked for names
        the launcher keeps (launcher/figures.py); then the settings that name a figure, where this row is
        the first that can have it."""
        before = dict(row)
        self.recipe.report(row, self.device, self.strategy.world_size)
        check_report(before, row, {*(f"train_{n}" for n in self.step.sums.named),
                                   *(f"test_{n}" for n in self.evaluation.named)})
        self.named_figures.check(row)

    def _advise(self, row: dict[str, Any], epoch: int, compiled: bool) -> bool:
        """Say once per run what held training up (not judged on a first epoch that has more): its input, on
        a GPU; on the CPU, the threads of a run on a busy machine (stall.py)."""
        if epoch == 0 and self.cfg.epochs > 1:
            return False
        if self.device.type == "cpu":
            advice = thread_advice(torch.get_num_threads(), max(1, self.strategy.processes),
                                   available_cores(os.environ), os.getloadavg()[0], "OMP_NUM_THREADS" in self.env)
        elif self.device.type == "cuda":
            advice = input_advice(row["input_stall"], self.data.placement, self.data.megabytes, compiled)
        else:
            return False
        if advice:
            log.warning(advice)
        return advice is not None

    def _local_memory_mb(self) -> list[float]:
        """This rank's peak allocated and reserved GPU memory in the epoch (-1 on the CPU), read from the
        allocator's own counts: no wait for the device."""
        devices = self.strategy.memory_devices(self.device)
        if not devices:
            return [-1.0, -1.0]
        return [max(torch.cuda.max_memory_allocated(d) for d in devices) / 2**20,
                max(torch.cuda.max_memory_reserved(d) for d in devices) / 2**20]
