"""How a sweep on this host shares the GPUs between its runs (made-up inventories, no processes)."""

import csv
import json
import shutil
from pathlib import Path

import pytest

from launcher.host.packing import GpuPool, Need
from launcher.host.sweep import SweepJob, swept_keys


def test_a_two_gpu_host_runs_two_one_gpu_runs_at_once_on_different_gpus():
    pool = GpuPool(visible=2)
    first, second = pool.take(Need(1)), pool.take(Need(1))
    assert (first, second) == ([0], [1])  # the runs' CUDA_VISIBLE_DEVICES become 0 and 1
    assert pool.take(Need(1)) is None  # a third waits
    pool.give_back(first)
    assert pool.take(Need(1)) == [0]


def test_a_four_gpu_host_packs_two_gpu_and_one_gpu_runs():
    pool = GpuPool(visible=4)
    assert pool.take(Need(2)) == [0, 1]
    assert pool.take(Need(1)) == [2]
    assert pool.take(Need(2)) is None  # only GPU 3 is free
    assert pool.take(Need(1)) == [3]


def test_named_gpus_wait_for_exactly_those():
    pool = GpuPool(visible=2)
    assert pool.take(Need(1, (1,))) == [1]
    assert pool.take(Need(1, (1,))) is None
    assert pool.take(Need(1)) == [0]


def test_cpu_runs_take_turns_unless_told_otherwise():
    one, two = GpuPool(visible=0), GpuPool(visible=0, cpu_slots=2)
    assert one.take(Need(0)) == [] and one.take(Need(0)) is None
    assert two.take(Need(0)) == [] and two.take(Need(0)) == []


def test_the_swept_keys_are_the_ones_that_differ():
    jobs = [SweepJob(i, ["recipe=digits", f"batch_size={b}", "epochs=2"], None, None, Path("."))
            for i, b in enumerate((32, 64))]
    assert swept_keys(jobs) == ["batch_size"]


def test_a_finished_runs_line_shows_its_objective_and_throughput(tmp_path, capsys):
    """The line a sweep prints as each run ends said `no test` for a run ranked by test_rmse."""
    import json
    import time
    from types import SimpleNamespace

    from launcher.host.packing import SideBySide, _Running

    def finished(results: dict, objective: str) -> str:
        run = tmp_path / str(len(list(tmp_path.iterdir())))
        run.mkdir()
        (run / "results.json").write_text(json.dumps(results))
        (run / "result.json").write_text(json.dumps({"exit_code": 0}))
        job = SweepJob(0, ["recipe=regression"], None, SimpleNamespace(sweep=SimpleNamespace(objective=objective)),
                       run)
        SideBySide._finished(SimpleNamespace(), _Running(job, None, run / "result.json", time.monotonic()), 0)
        return capsys.readouterr().out

    own = {"test_acc": None, "objective": "test_rmse", "test_rmse": 0.4354, "final": {"samples_per_s": 23305.0}}
    assert ": test_rmse 0.4354, 23,305 samples/s\n" in finished(own, "test_rmse")
    assert ": test_rmse 0.4354, 23,305 samples/s\n" in finished(own, "test_acc")  # (ranked by its first figure)
    assert ": test acc 74.92%, 1,200 img/s\n" in finished({"test_acc": 0.7492, "final": {"img_per_s": 1200.0}},
                                                         "test_acc")


def test_named_gpus_wait_until_every_one_of_them_is_free():
    pool = GpuPool(visible=2)
    assert pool.take(Need(1, (1,))) == [1]
    assert pool.take(Need(2, (0, 1))) is None  # GPU 1 is still another run's
    pool.give_back([1])
    assert pool.take(Need(2, (0, 1))) == [0, 1]


# ---- what a sweep run reports: to Hydra's sweeper, in the summary, in the exit code -------------------

def _job(num, tmp_path, results=None, exit_code=0, seconds=0.0, overrides=None, objective="test_acc"):
    from omegaconf import OmegaConf

    from tests.conftest import config_of

    run_dir = tmp_path / str(num)
    run_dir.mkdir(parents=True, exist_ok=True)
    if results is not None:
        (run_dir / "results.json").write_text(json.dumps(results))
    job = SweepJob(num, overrides or [f"lr={num}"], OmegaConf.create({"hydra": {"job": {"name": "launch"}}}),
                   config_of(f"sweep.objective={objective}"), run_dir)
    job.finished(exit_code, None if exit_code == 0 else "it failed", seconds)
    return job


def test_a_failed_run_reaches_the_sweeper_as_a_failure_with_its_exit_code(tmp_path):
    from hydra.core.utils import JobStatus

    from launcher.host.outcome import RunFailed

    failed = _job(0, tmp_path, exit_code=130).job_return()
    assert failed.status == JobStatus.FAILED
    assert isinstance(failed._return_value, RunFailed) and failed._return_value.exit_code == 130
    done = _job(1, tmp_path, results={"test_acc": 0.9}).job_return()
    assert done.status == JobStatus.COMPLETED and done.return_value == 0.9


def test_the_objective_is_the_figure_named_or_the_final_epochs_or_a_recipes_own():
    from launcher.host.outcome import objective_of

    assert objective_of({"test_acc": 0.5, "final": {"test_acc": 0.4}}, "test_acc") == 0.5
    assert objective_of({"final": {"test_acc": 0.4}}, "test_acc") == 0.4  # (a run without its top-level figure)
    # a recipe without accuracy (a regression): the default objective is its own first held-out figure
    assert objective_of({"objective": "test_rmse", "test_rmse": 0.25}, "test_acc") == 0.25
    assert objective_of({"test_acc": True}, "test_acc") is None


def test_the_summary_shows_each_runs_figures_time_and_the_best_run_by_its_direction(tmp_path):
    from launcher.host.sweep import write_summary

    jobs = [_job(0, tmp_path, {"objective": "test_rmse", "test_rmse": 0.5, "final": {"loss": 0.25}}, seconds=12.0,
                 objective="test_rmse"),
            _job(1, tmp_path, {"objective": "test_rmse", "test_rmse": 0.2, "worker_s": 30.0}, objective="test_rmse")]
    table = write_summary(jobs, tmp_path)
    assert "best: job 1 (lr=1), test_rmse 0.2" in table  # the smaller error, not the larger
    rows = list(csv.DictReader(open(tmp_path / "summary.csv")))
    assert [r["seconds"] for r in rows] == ["12.0", "30.0"]  # a SLURM run's time: its workers' (results.json)
    accuracy = write_summary([_job(2, tmp_path, {"test_acc": 0.8512})], tmp_path / "acc")
    assert "| 85.12% |" in accuracy
    # an accuracy sweep names its best run too (it printed none), with where that run is
    acc = tmp_path / "acc2"
    table = write_summary([_job(3, acc, {"test_acc": 0.91, "final": {"samples_per_s": 5000.0}}),
                           _job(4, acc, {"test_acc": 0.95, "final": {"samples_per_s": 4000.0}})], acc)
    assert f"best: job 4 (lr=4), test_acc 95.00%: {acc / '4'}" in table
    rows = list(csv.DictReader(open(acc / "summary.csv")))
    assert [r["samples_per_s"] for r in rows] == ["5000.0", "4000.0"]  # (the table's throughput, kept in the csv)


def test_a_sweep_with_a_failed_run_still_names_its_best_and_an_image_folders_throughput_is_shown(tmp_path):
    """A new user's trial: one run of two failing (a batch larger than the data) left the other's best line out,
    and recipe=imagefolder's throughput (`images_per_s`) was `-` in the table, empty in summary.csv."""
    from launcher.host.packing import finished_line
    from launcher.host.sweep import write_summary

    jobs = [_job(0, tmp_path, {"test_acc": 0.6667, "final": {"images_per_s": 185.4}}),
            _job(1, tmp_path, exit_code=2)]
    table = write_summary(jobs, tmp_path)
    assert f"best: job 0 (lr=0), test_acc 66.67%: {tmp_path / '0'}" in table, table
    assert "| 185 |" in table or "| 185.4 |" in table, table
    assert [r["img_per_s"] for r in csv.DictReader(open(tmp_path / "summary.csv"))] == ["185.4", ""]
    assert "185 images/s" in finished_line(jobs[0])


def test_a_run_killed_before_it_reported_fails_with_128_plus_its_signal(tmp_path, capsys):
    """A sweep run's process killed outright (the OOM killer) writes no result: its exit code is the shell's
    128+N, which the sweep's own exit code and summary then carry."""
    import signal
    import time

    from launcher.host.packing import SideBySide, _Running

    job = _job(0, tmp_path, exit_code=0)
    (job.run_dir / "launch.out").write_text("launch: training\n")
    entry = _Running(job, None, tmp_path / "no-result.json", time.monotonic())
    SideBySide.__new__(SideBySide)._finished(entry, -signal.SIGKILL)
    assert job.exit_code == 128 + signal.SIGKILL and "killed by SIGKILL" in job.error
    assert f"FAILED (exit {128 + signal.SIGKILL})" in capsys.readouterr().err


def test_cpu_runs_side_by_side_share_the_cores_and_a_users_thread_count_wins(monkeypatch):
    from launcher.host import packing

    monkeypatch.setattr(packing, "available_cores", lambda env: 8)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    two = packing.SideBySide(None, None, parallel=2)
    try:
        assert two._child_env([])["OMP_NUM_THREADS"] == "4"
        assert "OMP_NUM_THREADS" not in two._child_env([0])  # (a GPU run: its plan sets its own)
        monkeypatch.setenv("OMP_NUM_THREADS", "3")
        assert two._child_env([])["OMP_NUM_THREADS"] == "3"
    finally:
        shutil.rmtree(two.scratch, ignore_errors=True)


def test_a_sweep_runs_process_hands_back_the_runs_own_exit_code(tmp_path, monkeypatch):
    """launcher/host/sweep_job.py: what the run's process writes for the sweep and exits with is the run's
    exit code (2 for bad input, 130 for Ctrl-C), not a plain failure."""
    import cloudpickle
    from hydra.core.utils import JobReturn, JobStatus

    from launcher import lifetime
    from launcher.host import compose, spawn, sweep, sweep_job
    from launcher.host.outcome import RunFailed

    ret = JobReturn(status=JobStatus.FAILED)
    ret.return_value = RunFailed(130, "stopped by Ctrl-C")
    monkeypatch.setattr(sweep, "run_sweep_job", lambda *a: ret)
    monkeypatch.setattr(spawn, "prestart_worker_interpreter", lambda: None)
    monkeypatch.setattr(lifetime, "private_temp_dir", lambda: None)
    monkeypatch.setattr(compose, "register", lambda argv: None)
    payload, result = tmp_path / "job.pkl", tmp_path / "job.json"
    payload.write_bytes(cloudpickle.dumps((None, None, None)))
    assert sweep_job.main([str(payload), str(result)]) == 130
    assert json.loads(result.read_text()) == {"exit_code": 130, "error": "stopped by Ctrl-C"}


def test_each_sweep_run_is_checked_and_continues_its_checkpoints_settings_before_any_run_starts(tmp_path,
                                                                                                  monkeypatch):
    """launch's sweep launcher composes every run as Hydra does, then: a resume's settings carried where the
    run's overrides give none, and a bad value refused (exit 2) before the first run starts."""
    import types

    import torch
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module

    from launcher.errors import LaunchError
    from launcher.host.compose import register
    from launcher.host.sweep_launcher import SweepLauncher

    monkeypatch.chdir(tmp_path)
    torch.save({"net_state_dict": {}, "epoch": 1, "config": {"recipe": {"name": "digits"}, "optim": {"name": "sgd"},
                                                             "lr": 0.07, "epochs": 5}}, "ck.pt")

    def load_sweep_config(master, overrides):
        register(overrides)
        with initialize_config_module("launcher.conf", version_base="1.3"):
            return hydra_compose("config", overrides=["gpus=[]", *overrides], return_hydra_config=True)

    sweeper = SweepLauncher()
    sweeper.setup(hydra_context=types.SimpleNamespace(config_loader=types.SimpleNamespace(
        load_sweep_config=load_sweep_config)), task_function=None, config=None)
    job = sweeper._compose(0, ["resume=ck.pt", "seed=3"])
    assert (job.cfg.lr, job.cfg.epochs, job.cfg.seed) == (0.07, 5, 3)
    with pytest.raises(LaunchError, match=r"^epochs=0 is not valid.*\[sweep run 1: epochs=0\]"):
        sweeper._compose(1, ["epochs=0"])


def test_the_summary_table_shows_what_each_run_was_given_that_the_others_were_not(tmp_path):
    """A new user's trial: the overrides column repeated every shared override on each row (recipe=text
    gpus=[] recipe.context=64 ...), burying the swept values; summary.csv keeps them all."""
    from launcher.host.sweep import write_summary

    shared = ["recipe=digits", "gpus=[]", "epochs=2"]
    jobs = [_job(n, tmp_path, {"test_acc": acc}, overrides=[*shared, f"lr={lr}", f"recipe.width={w}"])
            for n, (lr, w, acc) in enumerate([(0.1, 8, 0.5), (0.2, 8, 0.7)])]
    table = write_summary(jobs, tmp_path)
    assert "| job | swept |" in table and "| 0 | lr=0.1 |" in table and "| 1 | lr=0.2 |" in table, table
    assert "gpus=[]" not in table and f"best: job 1 (lr=0.2), test_acc 70.00%: {tmp_path / '1'}" in table
    rows = list(csv.DictReader(open(tmp_path / "summary.csv")))
    assert rows[1]["overrides"] == "recipe=digits gpus=[] epochs=2 lr=0.2 recipe.width=8"


def test_a_run_stopped_before_its_results_shows_the_epochs_it_logged_but_is_never_the_best(tmp_path):
    """A new user's trial: a sweep stopped by Ctrl-C showed its stopped run as `143 | - | -` (and the rate
    column as img_per_s) though it had trained 3 epochs to 97.53%: its row now shows its last logged epoch;
    the best line takes only runs that finished with their results."""
    from launcher.host.sweep import write_summary

    stopped = tmp_path / "1"
    stopped.mkdir()
    (stopped / "metrics.jsonl").write_text("".join(json.dumps(
        {"epoch": e, "loss": 1.0 / e, "test_acc": acc, "samples_per_s": 900.0}) + "\n"
        for e, acc in ((1, 0.9), (2, 0.9812), (3, 0.9753))) + '{"epoch": 4, "lo')  # (a line cut by the stop)
    jobs = [_job(0, tmp_path, {"test_acc": 0.95, "final": {"loss": 0.5, "samples_per_s": 1000.0, "epoch": 2}}),
            _job(1, tmp_path, exit_code=143)]
    table = write_summary(jobs, tmp_path)
    assert "| job | swept | exit_code | test_acc | loss | samples_per_s | seconds |" in table, table
    assert "| 1 | lr=1 | 143 | 97.53% | 0.3333 |" in table, table
    assert "best: job 0 (lr=0), test_acc 95.00%" in table  # (not the stopped run's 98.12%)
    rows = list(csv.DictReader(open(tmp_path / "summary.csv")))
    assert (rows[1]["best_test_acc"], rows[1]["epochs"]) == ("0.9812", "3"), rows[1]
    # a metrics.jsonl that is not a regular file (a FIFO would block its reader forever) is not read
    import os

    (tmp_path / "2").mkdir()
    os.mkfifo(tmp_path / "2" / "metrics.jsonl")
    assert _job(2, tmp_path, exit_code=143).logged == {}
