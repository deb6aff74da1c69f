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


def test_a_damaged_checkpoint_is_the_one_on_disk_once_the_saves_in_flight_are_written(tmp_path):
    """fault.kind=damage damaged last.pt while the previous epoch's save was still being written (CI, under
    load): that save then replaced it, and the restart found nothing damaged. The saves in flight are waited
    for first (the loop's writer.wait), then the file on disk is damaged."""
    import pytest

    last = tmp_path / "last.pt"
    last.write_bytes(b"epoch 1" * 2000)
    faults = Faults(FaultConfig(rank=0, step=3, kind="damage"), world(0, 2), torch.device("cpu"), last)
    faults.settle = lambda: last.write_bytes(b"epoch 2" * 2000)  # (the save in flight lands)
    with pytest.raises(RuntimeError, match="fault.kind=damage"):
        faults.at(3)
    assert last.read_bytes().startswith(b"epoch 2") and b"\x00" * 4096 in last.read_bytes()
