"""Epoch ends overlapped with the next epoch's first steps (GPU only: on the CPU the epoch before is read
before the next one starts). What a user must still see: a NaN stops every rank with the last good
checkpoint named and nothing of the NaN epoch saved; a rank that dies mid-epoch restarts from a
checkpoint and the run ends with every epoch recorded once."""

import json

import pytest
import torch

two_gpus = pytest.mark.two_gpus
# digits: 1,438 training images, 22 steps of 64 per epoch; compile off, so no epoch ends synchronously
# for perf.compile=auto's decision: epoch 1 is read inside epoch 2, epoch 2 inside epoch 3
DIGITS = ("recipe=digits", "gpus=[0,1]", "batch_size=64", "perf.compile=false")


def _rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@two_gpus
def test_a_nan_found_while_the_next_epoch_runs_stops_every_rank_before_anything_of_it_is_saved(launch):
    result = launch(*DIGITS, "epochs=4", "fault.rank=1", "fault.step=30", "fault.kind=nan", timeout=600)
    assert result.returncode == 1, result.output
    err = result.stderr
    assert "the training loss became nan in epoch 2 at step 9 of 22 (the run's step 31)" in err, err
    assert "(after epoch 1)" in err and "Traceback" not in err
    run_dir = result.run_dir()
    assert torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["epoch"] == 1
    rows = _rows(run_dir)
    assert [r["epoch"] for r in rows] == [1]  # the NaN epoch is not recorded
    assert rows[0]["max_mem_allocated_mb"] is not None  # it ran on the GPUs (None on the CPU)


@two_gpus
def test_a_rank_dying_mid_epoch_restarts_from_a_checkpoint_and_records_every_epoch_once(launch):
    result = launch(*DIGITS, "epochs=4", "max_restarts=1", "fault.rank=1", "fault.step=54", timeout=600)
    assert result.returncode == 0, result.output
    r = result.results()
    assert r["restarts"] == 1 and r["resumed_from"] and r["ranks_agree"] and r["device_type"] == "cuda", r
    rows = _rows(result.run_dir())
    assert [row["epoch"] for row in rows] == [1, 2, 3, 4], rows
    assert all(row["epoch_s"] > 0 and row["train_s"] > 0 and "test_acc" in row for row in rows)


def test_a_large_models_checkpoints_do_not_hold_up_its_epochs(launch):
    """~1 GB of weights and AdamW moments (a GPT of 12 x 768, vocabulary 256): each epoch's checkpoint is
    copied to pinned host memory held since the first step, not allocated at the epoch's end on the
    training thread (that took 1.1-1.9 s per epoch for GPT-2 124M on an H200 host, and under ddp every
    rank waited for it)."""
    result = launch("recipe=text", "gpus=[0]", "recipe.layers=12", "recipe.width=768", "recipe.heads=12",
                    "recipe.context=256", "batch_size=16", "recipe.max_bytes=400000", "epochs=4",
                    "perf.compile=false", "eval.every=0", "recipe.sample_bytes=0", timeout=600)
    assert result.returncode == 0, result.output
    rows = _rows(result.run_dir())
    assert len(rows) == 4 and all(r["max_mem_allocated_mb"] for r in rows)
    waits = [r["checkpoint_wait_s"] for r in rows]
    assert all(w < 0.25 for w in waits), waits  # (before: ~0.7 s at each of the first three epoch ends)
    assert rows[-1]["checkpoint_write_s"] > 0


def test_a_sharded_models_first_checkpoint_does_not_hold_up_its_steps(launch, tmp_path):
    """Under fsdp each rank copies its shards into a host copy kept for the run (~1 GB of weights and AdamW
    moments here, a GPT of 12 x 768). That copy is made on a thread after the first step, not by the first
    save on the training thread (an 8B model's, 16 GB a rank, held the steps of 2 H200s ~32 s): the first
    save holds the steps only while it queues the copies, and the next epoch starts when its steps can."""
    result = launch("recipe=text", "gpus=[0]", "strategy=fsdp", "recipe.layers=12", "recipe.width=768",
                    "recipe.heads=12", "recipe.context=256", "batch_size=16", "recipe.max_bytes=400000", "epochs=3",
                    "perf.compile=false", "eval.every=0", "recipe.sample_bytes=0", timeout=600)
    assert result.returncode == 0, result.output
    assert result.results()["device_type"] == "cuda"
    rows = _rows(result.run_dir())
    waits = [r["checkpoint_wait_s"] for r in rows]
    assert waits[0] < 0.5, waits  # (the first save: no save before it to wait for)
    held = [b["started_unix"] - a["started_unix"] - a["epoch_s"] for a, b in zip(rows, rows[1:], strict=False)]
    assert held[0] < 0.5 + waits[0], (held, waits)
    # what the last save copied into the host copy (page-locked, written by queued copies) is the weights
    # the run ended with: its checkpoint, evaluated, scores as the run's own last evaluation did
    evaluated = launch("eval", str(result.run_dir()), "gpus=[0]", timeout=600)
    assert evaluated.returncode == 0, evaluated.output
    [report] = [json.loads(p.read_text()) for p in tmp_path.glob("outputs/*/*/eval.json")]
    assert report["device_type"] == "cuda", report
    assert report["test_loss"] == pytest.approx(result.results()["test_loss"], abs=1e-3), report
