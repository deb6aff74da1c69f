"""What a run leaves to look at (TensorBoard, curves) and how a NaN loss ends it, on 2 gloo ranks."""

import json

import pytest
import torch

pytestmark = pytest.mark.distributed

DDP_CPU = ("recipe=digits", "gpus=[]", "strategy=ddp", "nprocs=2", "epochs=3")


def test_tensorboard_scalars_and_the_curves_png(launch):
    result = launch(*DDP_CPU)
    assert result.returncode == 0, result.output
    run_dir = result.run_dir()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "train/accuracy", "test/accuracy", "train/lr", "speed/img_per_s"} <= tags
    losses = [e.value for e in events.Scalars("train/loss")]
    metrics = [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3] and losses == pytest.approx(metrics)
    assert (run_dir / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"curves: {run_dir / 'curves.png'}" in result.output and f"tensorboard --logdir {run_dir}" in result.output


def test_a_nan_loss_stops_every_rank_and_names_the_step_and_the_last_good_checkpoint(launch):
    # 22 steps per epoch: fault.step=30 (from 0) is in epoch 2, so the last good checkpoint is epoch 1's
    result = launch(*DDP_CPU, "fault.rank=1", "fault.step=30", "fault.kind=nan")
    assert result.returncode == 1, result.output
    err = result.stderr
    assert "the training loss became nan in epoch 2 at step 9 of 22 (the run's step 31)" in err
    assert "last good checkpoint is" in err and "(after epoch 1)" in err and "Traceback" not in err
    run_dir = result.run_dir()
    assert torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["epoch"] == 1
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 1  # the NaN epoch is not recorded
