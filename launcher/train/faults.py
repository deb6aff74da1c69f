"""`fault.*`: a rank failing on purpose at a global step, to see supervision and its messages work.

    launch gpus=[] strategy=ddp nprocs=2 fault.rank=1 fault.step=30 fault.kind=raise|exit|kill|hang|nan|oom|damage
"""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path

import torch

from launcher.config import FaultConfig
from launcher.world import WorldInfo

log = logging.getLogger("launcher.train")


class Faults:
    def __init__(self, options: FaultConfig, world: WorldInfo, device: torch.device, last: Path | None = None):
        self.kind = options.kind
        self.last = last  # the run's checkpoints/last.pt (fault.kind=damage)
        self.settle = None  # waits for the checkpoints still being written (set by the loop; fault.kind=damage)
        self.rank = world.rank
        applies = options.rank == world.rank and options.attempt in (-1, world.restart_count)
        self.step = options.step if applies else -1  # the global step it fails at (-1: never, on this rank)
        if options.rank is None and (options.kind != "raise" or options.step != 0) and world.rank == 0:
            # (not refused: a sweep may set fault.rank=0,null to run with and without the fault)
            log.warning("fault.kind=%s fault.step=%d fail no rank: fault.rank is null (fault.rank=N names the rank "
                        "to fail)", options.kind, options.step)
        self.options, self.world_size = options, world.world_size
        if options.rank is not None and not 0 <= options.rank < world.world_size and world.rank == 0:
            log.warning("fault.rank=%d names no rank of this launch (ranks 0-%d): no fault is injected",
                        options.rank, world.world_size - 1)
        # fault.kind=nan: added to every step's loss; NaN from the injected step on (a tensor, so a
        # captured step sees it change)
        self.poison = torch.zeros((), device=device) if self.kind == "nan" else None

    def check_reach(self, total_steps: int, first_step: int) -> None:
        """Say (rank 0) when fault.step lies outside the steps this run trains: nothing would be injected."""
        o = self.options
        if self.rank == 0 and o.rank is not None and 0 <= o.rank < self.world_size \
                and not first_step <= o.step < total_steps:
            log.warning("fault.step=%d is outside the steps this run trains (%d-%d): no fault is injected",
                        o.step, first_step, total_steps - 1)

    def at(self, global_step: int) -> None:
        """Called every step: plain int comparison first, it must cost nothing."""
        if global_step != self.step:
            return
        log.warning("injecting fault.kind=%s at step %d", self.kind, global_step)
        if self.kind == "raise":
            raise RuntimeError(f"injected failure (fault.kind=raise) on rank {self.rank} at step {global_step}")
        if self.kind == "exit":
            os._exit(3)
        if self.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.kind == "oom":  # what the allocator raises, to test the report on any device
            raise torch.OutOfMemoryError(f"injected (fault.kind=oom) on rank {self.rank} at step {global_step}")
        if self.kind == "nan":
            assert self.poison is not None
            self.poison.fill_(float("nan"))
            return
        if self.kind == "damage":  # the checkpoint's bytes changed under it (a failing disk), then the rank fails
            if self.settle is not None:  # (the checkpoint on disk, not one a save still in flight then replaces)
                self.settle()
            if self.last is not None and self.last.is_file():
                with open(self.last, "r+b") as f:
                    f.seek(self.last.stat().st_size // 2)
                    f.write(b"\x00" * 4096)
            raise RuntimeError(f"injected failure (fault.kind=damage: {self.last} overwritten in part) on rank "
                               f"{self.rank} at step {global_step}")
        if self.kind == "hang":
            while True:
                time.sleep(60)
