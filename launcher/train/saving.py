"""The checkpoints a run writes while it trains (where `cfg.saves`), and the best ones beside them.

Each epoch's checkpoint is copied from the device at the epoch's end (`snapshot`: rank 0's tensors staged in
one device buffer, then one copy to page-locked memory) and written once the epoch is read (`epoch_done`),
off the training thread (checkpoint.BackgroundWriter); under a sharded strategy every rank writes its
shards at the epoch's end instead. `checkpoint_every_steps` adds checkpoints inside an epoch, with their
position in it (`within_epoch`). checkpoint.keep_best links the best epochs' checkpoints beside last.pt
(best.py), by checkpoint.metric, once each epoch's last.pt is on disk.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from launcher.config import DEFAULT_OBJECTIVE, figure_key, smaller_is_better, to_plain
from launcher.files import last_checkpoint
from launcher.train import checkpoint
from launcher.train.best import BestCheckpoints
from launcher.train.early_stop import check_named, default_figure

if TYPE_CHECKING:
    from launcher.config import Config
    from launcher.strategies import Strategy
    from launcher.train.step import TrainStep
    from launcher.train.threads import Asides

log = logging.getLogger("launcher.train")


class Saves:
    """A run's checkpoints of the state `step` trains (its nets, optimizers and gradient scaler), written
    in `run_dir` by `writer`. Each holds the run's config and, where the data names them, the classes its
    outputs are (`classes`, in label order)."""

    def __init__(self, cfg: Config, strategy: Strategy, device: torch.device, run_dir: Path,
                 writer: checkpoint.BackgroundWriter, step: TrainStep, classes: list[str] | None = None):
        self.cfg, self.strategy, self.device, self.run_dir = cfg, strategy, device, run_dir
        self.plain: dict[str, Any] = {"config": to_plain(cfg), **({"classes": list(classes)} if classes else {})}
        self.writer = writer
        self.step = step
        self.is_main = strategy.is_main
        self.stager: checkpoint.Stager | None = None  # rank 0 on a GPU: checkpoint copies staged on the device
        self.best: BestCheckpoints | None = None  # checkpoint.keep_best (rank 0, from the first evaluation)
        self.said_sharded_steps = False  # checkpoint_every_steps under a sharded strategy was said (once)

    def warm_pinned_memory(self, asides: Asides) -> None:
        """Page-locked memory for the checkpoints in flight (the one being copied and those the writer
        holds), allocated on a thread at the first step rather than at the first epoch's end; under a
        sharded strategy, every rank's host copy of its shards (made on the CPU too: shared memory)."""
        if self.strategy.sharded and self.cfg.saves:
            checkpoint.make_shards_host_copy(self.strategy, self.step.nets, self.step.steppers, self.device,
                                             self.writer, asides)
        elif self.is_main and self.cfg.saves and self.device.type == "cuda":
            state = checkpoint.capture(self.strategy, self.step.nets, self.step.steppers, self.device)
            asides.start(self.device, checkpoint.warm_pinned_memory, state,
                         copies=checkpoint.BackgroundWriter.QUEUED + 1)

    def snapshot(self) -> checkpoint.HostSnapshot | None:
        """Rank 0, unsharded: the state after the epoch, its copy to host memory queued now (the next steps
        change the weights in place); completed and written when the epoch is read (`epoch_done`)."""
        if not (self.is_main and self.cfg.saves and not self.strategy.sharded):
            return None
        return self._snapshot()

    def _snapshot(self) -> checkpoint.HostSnapshot:
        if self.stager is None and self.device.type == "cuda":
            self.stager = checkpoint.Stager(self.device)
        step = self.step
        return checkpoint.HostSnapshot(checkpoint.capture(self.strategy, step.nets, step.steppers, self.device,
                                                          scaler=step.scaler), self.stager)

    def within_epoch(self, epoch: int, done: int, generator: torch.Generator,
                     history: list[dict[str, Any]]) -> None:
        """`checkpoint_every_steps`: the state after `done` steps of `epoch`, with that position, so a
        restart or a resume continues the epoch's order from the next step (on any number of ranks: the
        order is global). Not under sharded strategies (their checkpoints are written at epoch ends)."""
        if self.strategy.sharded:
            if not self.said_sharded_steps and self.is_main:
                log.warning("checkpoint_every_steps: strategy=%s writes its sharded checkpoints at epoch ends only",
                            self.strategy.name)
            self.said_sharded_steps = True
            return
        if not self.is_main:
            return
        snapshot = self._snapshot()
        snapshot.add(epoch=epoch, step_in_epoch=done, batch_size=self.cfg.batch_size,
                     generator=generator.get_state(), history=list(history), **self.plain)
        self.writer.submit(snapshot, last_checkpoint(self.run_dir), previous=self.cfg.checkpoint.keep_previous)

    def make_room(self, row: dict[str, Any], snapshot_s: float) -> None:
        """What the epoch's checkpoint cost training on rank 0 (under ddp every rank waits for it at its next
        all-reduce): queuing the copies (`snapshot_s`) and waiting for earlier writes, added to what the
        epoch's end waited for the memory they take (EpochEnds.queue); and how long a write takes. Both go
        into the epoch's row."""
        waited = self.writer.make_room()
        row["checkpoint_wait_s"] = round(row.get("checkpoint_wait_s", 0.0) + snapshot_s + waited, 4)
        if self.writer.last_write_s is not None:
            row["checkpoint_write_s"] = round(self.writer.last_write_s, 3)

    def epoch_done(self, snapshot: checkpoint.HostSnapshot | None, row: dict[str, Any],
                   history: list[dict[str, Any]]) -> None:
        """The checkpoint after the epoch of `row` (its figures read, `history` up to it): rank 0's snapshot
        completed and handed to the writer, or, sharded, every rank's shards written now (its epochs end at
        once: the state is the epoch's); and among the best ones, where it is."""
        cfg, epochs = self.cfg, int(row["epoch"])
        then = self._best_after(row)  # (checkpoint.keep_best: this epoch is among the best)
        if snapshot is not None:
            snapshot.add(epoch=epochs, history=list(history), **self.plain)
            self.writer.submit(snapshot, last_checkpoint(self.run_dir),
                               then=then, previous=cfg.checkpoint.keep_previous)
        elif self.strategy.sharded and cfg.saves:
            step = self.step
            checkpoint.save_sharded(self.strategy, step.nets, step.steppers, self.device, last_checkpoint(self.run_dir),
                                    epochs, {"epoch": epochs, "history": list(history), **self.plain},
                                    writer=self.writer, then=then, previous=cfg.checkpoint.keep_previous, row=row)

    def _best_after(self, row: dict[str, Any]) -> Callable[[Path, str | None], None] | None:
        """checkpoint.keep_best on rank 0: where this epoch is among the best so far by checkpoint.metric,
        what the checkpoint writer does once its last.pt is on disk (link it as one of the best)."""
        section = self.cfg.checkpoint
        if not (section.keep_best and self.is_main and self.cfg.saves):
            return None
        if self.best is None:
            objective = self.cfg.sweep.objective if self.cfg.sweep.objective != DEFAULT_OBJECTIVE else None
            typed = section.metric or self.cfg.early_stop.metric or objective
            key = figure_key(typed) if typed else default_figure(row)
            if key is None or (key.startswith("test_") and not any(k.startswith("test_") for k in row)):
                return None  # (not evaluated after this epoch: eval.every)
            check_named(key, typed or key, "checkpoint.metric", row)
            mode = section.mode if section.metric or not self.cfg.early_stop.metric else self.cfg.early_stop.mode
            self.best = BestCheckpoints(last_checkpoint(self.run_dir).parent, section.keep_best, key,
                                        smaller_is_better(key, mode))
        best, epoch, value = self.best, int(row["epoch"]), row.get(self.best.key)
        if not best.ranks(epoch, value):
            return None
        return lambda last, shards: best.keep(epoch, float(value), last, shards)

    @property
    def kept(self) -> dict[str, Any] | None:
        """What results.json says of the best checkpoints: their figure and the epochs kept."""
        return {"metric": self.best.key, "kept": self.best.kept} if self.best is not None else None
