"""One launch on this host (launcher/host/run_here.py), in this process with nothing started: which run dirs it
refuses, its last line, how it records its end, a node's limits on the rendezvous."""

from __future__ import annotations

import json
import logging

from launcher.host import run_here
from launcher.host.outcome import LaunchContext, Outcome
from launcher.spec import RequeuePolicy
from tests.conftest import config_of

DRY = ("gpus=[]", "dry_run=true")


def test_a_run_dir_holding_a_finished_or_stopped_run_is_never_run_into(tmp_path):
    finished, stopped = tmp_path / "finished", tmp_path / "stopped"
    (finished / "results.json").parent.mkdir()
    (finished / "results.json").write_text("{}")
    (stopped / "checkpoints").mkdir(parents=True)
    (stopped / "checkpoints" / "last.pt").write_bytes(b"x")  # (Ctrl-C'd: a checkpoint, no results)
    for run_dir in (finished, stopped):
        outcome = run_here.run_here(config_of(*DRY), run_dir, LaunchContext(started=0.0))
        assert outcome.exit_code == 2 and "already holds a run: continue it with resume=" in outcome.error


def test_a_slurm_jobs_first_run_is_refused_a_finished_dir_and_only_its_requeued_run_continues_it(tmp_path):
    (tmp_path / "results.json").write_text("{}")
    first = LaunchContext(started=0.0, requeue=RequeuePolicy("77", restart_count=0, max_requeues=3))
    assert run_here.run_here(config_of(*DRY), tmp_path, first).exit_code == 2
    again = LaunchContext(started=0.0, requeue=RequeuePolicy("77", restart_count=1, max_requeues=3))
    assert run_here.run_here(config_of(*DRY), tmp_path, again).exit_code == 0


def test_the_last_line_gives_accuracy_in_percent_and_a_recipes_own_objective_first(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="launcher"):
        run_here.summarize({"test_acc": 0.9123, "final": {"loss": 0.3}}, tmp_path, 1.0)
        run_here.summarize({"objective": "test_rmse", "final": {"test_mae": 0.5, "test_rmse": 0.25}}, tmp_path, 1.0)
    first, second = [r.getMessage() for r in caplog.records]
    assert "test accuracy 91.23%" in first
    assert "done in 1.0s: test_rmse 0.25, test_mae 0.5." in second


def test_a_launch_stopped_by_a_signal_is_recorded_so_and_runs_lists_it_stopped(tmp_path):
    from launcher.host.runs import describe

    run_here._record_outcome(tmp_path, Outcome(130, error="stopped by SIGINT"))
    assert json.loads((tmp_path / "outcome.json").read_text())["stopped_by"] == "SIGINT"
    assert describe(tmp_path)["state"] == "stopped (SIGINT)"


def test_a_node_gives_up_on_a_silent_rendezvous_within_30_s_and_no_sooner_than_10(tmp_path):
    import socket

    from launcher.host.plan import make_plan

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    node = ("gpus=[]", "strategy=ddp", "nprocs=2", "nodes=2", "node_rank=0", f"rdzv=127.0.0.1:{port}")
    assert run_here.nodes_of(make_plan(config_of(*node))).store_read_s == 30  # (strategy.timeout_s=600)
    assert run_here.nodes_of(make_plan(config_of(*node, "strategy.timeout_s=5"))).store_read_s == 10
    assert run_here.nodes_of(make_plan(config_of(*node, "strategy.timeout_s=20"))).store_read_s == 20
