"""The trainer's set-up work on threads of its own (TensorBoard's writer opened beside the warm-up, the
checkpoints' pinned memory beside the first epoch, so the first epoch's GPU does not wait for them):
what they write arrives, and what fails there is raised on the training thread, not lost."""

import pytest
import torch

from launcher.train.reporting import TensorBoardLog
from launcher.train.threads import Aside, Asides, profiled


def test_tensorboard_opened_on_a_thread_writes_each_epoch(tmp_path):
    log = TensorBoardLog(tmp_path, enabled=True)
    Aside(None, log.open).wait()
    log.epoch({"epoch": 1, "loss": 2.5, "lr": 0.1})
    log.epoch({"epoch": 2, "loss": 1.5, "lr": 0.1})
    log.close()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(1, 2.5), (2, 1.5)]


def test_a_failure_to_open_tensorboard_on_its_thread_is_raised_when_waited_for(tmp_path):
    (tmp_path / "tensorboard").write_text("a file where the folder should go")
    log = TensorBoardLog(tmp_path, enabled=True)
    aside = Aside(None, log.open)
    with pytest.raises(OSError):
        aside.wait()


def test_disabled_tensorboard_writes_nothing(tmp_path):
    log = TensorBoardLog(tmp_path, enabled=False)
    Aside(None, log.open).wait()
    log.epoch({"epoch": 1, "loss": 2.5})
    log.close()
    assert not (tmp_path / "tensorboard").exists()


def test_set_up_work_aside_runs_and_its_failure_is_raised_on_wait():
    done = []
    Aside(torch.device("cpu"), done.append, "pinned").wait()
    assert done == ["pinned"]

    def fails():
        raise RuntimeError("cudaHostAlloc failed")

    aside = Aside(torch.device("cpu"), fails)
    with pytest.raises(RuntimeError, match="cudaHostAlloc"):
        aside.wait()


def test_a_runs_set_up_threads_are_each_waited_for_once_and_a_failure_is_raised_unless_the_run_is_leaving():
    """At the first epoch's end a failure on a set-up thread stops the run; on the way out of a run that failed,
    the run's own error is what is said (`quiet`)."""
    asides, done = Asides(), []

    def fails():
        raise OSError("No space left on device")

    asides.start(None, done.append, "opened")
    asides.start(None, fails)
    with pytest.raises(OSError, match="No space"):
        asides.wait()
    assert done == ["opened"]
    asides.wait()  # (nothing left to wait for)
    asides.start(None, fails)
    asides.wait(quiet=True)


def test_a_profiled_epoch_leaves_its_table_of_ops_and_a_trace(tmp_path):
    with profiled(tmp_path):
        torch.ones(64, 64) @ torch.ones(64, 64)
    assert "aten::mm" in (tmp_path / "profile.txt").read_text()
    assert (tmp_path / "trace.json").stat().st_size > 0


def test_tensorboard_puts_each_figure_under_its_own_tag(tmp_path):
    log = TensorBoardLog(tmp_path, enabled=True)
    log.epoch({"epoch": 1, "loss": 2.5, "test_loss": 3.0, "train_mse": 0.5, "test_mse": 0.25, "train_s": 9.0})
    log.close()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    drawn = {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    assert drawn == {"train/loss": [(1, 2.5)], "test/loss": [(1, 3.0)], "train/mse": [(1, 0.5)],
                     "test/mse": [(1, 0.25)]}  # (train_s, the epoch's seconds, is no figure)
