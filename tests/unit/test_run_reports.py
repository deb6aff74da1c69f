"""What a run tells its user about itself, read without starting one: the live bar's figures (rate, the run's
ETA) and when it is drawn, the epoch line, results.json's figures, and where a NaN loss stopped the run."""

import functools
import json
import math

import torch

from launcher.files import last_checkpoint
from launcher.train import progress, results
from launcher.train.stops import non_finite_loss
from tests.conftest import config_of

CPU = torch.device("cpu")
composed = functools.cache(functools.partial(config_of, "recipe=digits", "gpus=[]"))


def test_the_bar_shows_samples_per_second_and_the_whole_runs_time_left():
    bar = progress.EpochBar(True, CPU, epochs=10)
    # epoch 3 of 10, 5 of its 10 steps of 32 images done in 2 s: 80 img/s; 4 s an epoch, so 2 s left of
    # this one and 7 epochs after it: 30 s
    assert bar._parts(2, 5, 10, 32, 2.0) == ["80 img/s", "run ETA 0m30s"]
    bar.epoch_seconds = [60.0, 80.0]  # finished epochs: their mean (70 s) from then on
    bar.last_loss = 0.123456
    assert bar._parts(2, 5, 10, 32, 2.0) == ["80 img/s", "run ETA 8m45s", "loss 0.1235"]


def test_progress_auto_draws_the_bar_on_a_terminal_only_and_on_rank_0_only(monkeypatch):
    monkeypatch.setattr("sys.stdout.isatty", lambda: False)  # a pipe, a log file, CI
    assert not progress.wanted("auto", True) and progress.wanted("bar", True)
    monkeypatch.setattr("sys.stdout.isatty", lambda: True)
    assert progress.wanted("auto", True) and not progress.wanted("lines", True)
    assert not progress.wanted("auto", False) and not progress.wanted("bar", False)  # (other ranks never)


def test_the_epoch_line_shows_each_figure_under_its_own_name():
    row = {"epoch": 3, "loss": 0.25, "train_acc": 0.9, "test_acc": 0.75, "test_loss": 0.5, "img_per_s": 1234.5,
           "input_stall": 0.125, "epoch_s": 2.5, "skipped": 2}
    line = results.epoch_line(row, 10, "img")
    assert line == ("epoch  3/10  loss 0.2500  train 90.00%  test 75.00%  1,234 img/s  skipped 2  input wait 12.5%  "
                    "2.50s")


def finished(tmp_path, history, digests, *overrides):
    """results.json of a run with this history, as rank 0 writes it at the end; what it holds."""
    cfg = composed(*overrides)
    record = results.RunRecord(
        cfg=cfg, strategy="single", world_size=1, batch_per_process=cfg.batch_size, gradient_sync=None, sharding=None,
        device_type="cpu", ranks=results.RankFacts(digests, ["cpu"] * len(digests), ["here"] * len(digests)),
        synthetic_data=False, data_placement="resident", compiled=False, compile_decision="", cuda_graph=False,
        cudnn_benchmark=False, fp16=False, stopped_early=None, best_checkpoint=None,
        timings=results.Timings(train_s=1.0, eval_s=0.5, warmup_s=0.0, first_step_s=2.0), started_unix=0.0,
        startup={}, resumed_from=None, restarts=0, worker_s=3.0)
    results.write(tmp_path, record, history)
    return json.loads((tmp_path / "results.json").read_text())


def epoch(n, **figures):
    return {"epoch": n, "loss": 1.0 / n, "input_stall": 0.0, **figures}


def test_results_json_has_the_best_epochs_figure_every_skipped_sample_and_whether_the_ranks_agree(tmp_path):
    history = [epoch(1, test_acc=0.5, test_loss=0.9, skipped=1), epoch(2, test_acc=0.9, test_loss=0.4),
               epoch(3, test_acc=0.7, test_loss=0.6, skipped=2)]
    got = finished(tmp_path, history, ["a1", "a1"])
    assert got["best_test_acc"] == 0.9 and got["test_acc"] == 0.7 and got["epochs_run"] == 3
    assert got["skipped_samples"] == 3 and got["ranks_agree"] is True
    by_loss = finished(tmp_path, history, ["a1", "b2"], "sweep.objective=test_loss")
    assert by_loss["objective"] == "test_loss" and by_loss["best_test_loss"] == 0.4  # (a loss: the least)
    assert by_loss["ranks_agree"] is False  # two ranks whose weights differ


def test_a_nan_loss_names_the_step_of_its_epoch_and_the_last_good_checkpoint(tmp_path):
    cfg = composed()
    last = last_checkpoint(tmp_path)
    last.parent.mkdir(parents=True)
    last.write_bytes(b"")
    # global step 30 of 22-step epochs: the 9th step of the second epoch
    message = str(non_finite_loss(cfg, tmp_path, 1, math.nan, 30, 22))
    assert "became nan in epoch 2 at step 9 of 22 (the run's step 31)" in message
    assert f"the last good checkpoint is {last} (after epoch 1)" in message
    first = str(non_finite_loss(cfg, tmp_path, 0, math.inf, 0, 22))
    assert "in epoch 1 at step 1 of 22 (the run's step 1)" in first and "no checkpoint precedes it" in first



def test_curves_put_a_loss_that_falls_by_orders_of_magnitude_on_a_log_axis():
    """On a linear axis a loss from 2.3 to 0.002 showed the first epoch and a flat line on the floor."""
    from launcher.train.reporting import curves_figure

    falling = [{"epoch": e, "loss": 2.3 / 10 ** e, "test_loss": 2.0 / 10 ** e, "train_acc": 0.5} for e in range(1, 5)]
    level = [{"epoch": e, "loss": 1.0 - 0.1 * e, "train_acc": 0.5} for e in range(1, 5)]
    assert curves_figure(falling).axes[0].get_yscale() == "log"
    assert curves_figure(level).axes[0].get_yscale() == "linear"
