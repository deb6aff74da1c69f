"""fault.*: a fault that would never be injected says so on rank 0 (not refused: a sweep may vary it)."""

import logging

import torch

from launcher.config import FaultConfig
from launcher.train.faults import Faults
from launcher.world import WorldInfo


def world(rank: int, size: int) -> WorldInfo:
    return WorldInfo(rank=rank, local_rank=rank, world_size=size, local_world_size=size, master_addr="127.0.0.1",
                     master_port=29500)


def test_a_rank_outside_the_launch_or_a_step_outside_the_run_is_said(caplog):
    cpu = torch.device("cpu")
    with caplog.at_level(logging.WARNING, logger="launcher.train"):
        Faults(FaultConfig(rank=2, step=5), world(0, 2), cpu)
        assert "fault.rank=2 names no rank of this launch (ranks 0-1)" in caplog.text
        caplog.clear()
        faults = Faults(FaultConfig(rank=1, step=500), world(0, 2), cpu)
        faults.check_reach(total_steps=120, first_step=0)
        assert "fault.step=500 is outside the steps this run trains (0-119)" in caplog.text
        caplog.clear()
        faults = Faults(FaultConfig(rank=1, step=50), world(0, 2), cpu)
        faults.check_reach(total_steps=120, first_step=0)
        Faults(FaultConfig(rank=1, step=50), world(1, 2), cpu).check_reach(120, 0)
        assert caplog.text == ""
