"""TensorBoard opened on a thread of its own (so the first epoch's GPU does not wait for its import), and
the trainer's other set-up thread: what they write arrives, and what fails there is raised, not lost."""

import pytest
import torch

from launcher.train.loop import _Aside
from launcher.train.reporting import TensorBoardLog


def test_tensorboard_opened_in_the_background_writes_each_epoch(tmp_path):
    log = TensorBoardLog(tmp_path, enabled=True)
    log.open_in_background()
    log.epoch({"epoch": 1, "loss": 2.5, "lr": 0.1})
    log.epoch({"epoch": 2, "loss": 1.5, "lr": 0.1})
    log.close()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(1, 2.5), (2, 1.5)]


def test_a_failure_to_open_tensorboard_in_the_background_is_raised_at_the_first_epoch(tmp_path):
    (tmp_path / "tensorboard").write_text("a file where the folder should go")
    log = TensorBoardLog(tmp_path, enabled=True)
    log.open_in_background()
    with pytest.raises(OSError):
        log.epoch({"epoch": 1, "loss": 2.5})


def test_disabled_tensorboard_starts_no_thread_and_writes_nothing(tmp_path):
    log = TensorBoardLog(tmp_path, enabled=False)
    log.open_in_background()
    log.epoch({"epoch": 1, "loss": 2.5})
    log.close()
    assert not (tmp_path / "tensorboard").exists()


def test_set_up_work_aside_runs_and_its_failure_is_raised_on_wait():
    done = []
    _Aside(torch.device("cpu"), done.append, "pinned").wait()
    assert done == ["pinned"]

    def fails():
        raise RuntimeError("cudaHostAlloc failed")

    aside = _Aside(torch.device("cpu"), fails)
    with pytest.raises(RuntimeError, match="cudaHostAlloc"):
        aside.wait()
