"""Trackers, early stopping and the best checkpoints on GPUs (issue 35), where an epoch's end normally
overlaps the next epoch's first steps: early stopping must decide before those steps change the weights,
and the best checkpoints are linked on the checkpoint writer's thread."""

import json

import pytest
import torch

two_gpus = pytest.mark.two_gpus


def _rows(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("gpus", ["[0]", pytest.param("[0,1]", marks=two_gpus)])
def test_a_stalled_figure_stops_the_run_and_the_best_epoch_evaluates_as_it_trained(launch, tmp_path, gpus):
    # lr=1e-9 on generated images: the held-out loss stays near ln 10 (within min_delta: BatchNorm's running
    # statistics still move), so patience 2 stops the run after epoch 3
    result = launch("recipe=cifar10", "data.synthetic=true", f"gpus={gpus}", "epochs=8", "lr=1e-9",
                    "early_stop.metric=val/loss", "early_stop.patience=2", "early_stop.min_delta=0.05",
                    "checkpoint.keep_best=2", "checkpoint.metric=test_loss", "log=[tensorboard,csv]",
                    "hydra.run.dir=run", timeout=600)
    assert result.returncode == 0, result.output
    run_dir = tmp_path / "run"
    r = json.loads((run_dir / "results.json").read_text())
    assert r["device_type"] == "cuda" and r["stopped_early"]["epoch"] == 3 and r["epochs_run"] == 3
    assert r["ranks_agree"]
    # the checkpoint is epoch 3's: no step of a fourth epoch ran before the decision
    state = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True, map_location="cpu")
    assert state["epoch"] == 3 and len(_rows(run_dir)) == 3
    assert len((run_dir / "metrics.csv").read_text().splitlines()) == 4
    kept = json.loads((run_dir / "checkpoints" / "best.json").read_text())["kept"]
    held = {row["epoch"]: row["test_loss"] for row in _rows(run_dir)}
    assert [e["epoch"] for e in kept] == sorted(held, key=lambda e: (held[e], e))[:2]
    evaluated = launch("eval", "run", "best", f"gpus={gpus}", timeout=600)
    assert evaluated.returncode == 0, evaluated.output
    [report] = [json.loads(p.read_text()) for p in tmp_path.glob("outputs/*/*/eval.json")]
    assert report["trained_epochs"] == kept[0]["epoch"]
    assert report["test_loss"] == pytest.approx(kept[0]["value"], rel=1e-3)
