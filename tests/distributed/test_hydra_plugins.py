"""`launch -m` under Hydra's other launchers and sweepers, with the real plugins installed: every run trains
(or the sweep is refused in one line, exit 2), a failed run fails the sweep, and each run's objective reaches
the sweeper."""

import json

import pytest
import yaml

pytestmark = pytest.mark.distributed

CPU = ("gpus=[]", "epochs=1")


def _results(result) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(result.cwd.glob("multirun/*/*/*/results.json"))]


@pytest.mark.parametrize("launcher", ["joblib", "submitit_local", "basic"])
def test_every_run_trains_under_another_launcher(launch, launcher):
    result = launch("-m", f"hydra/launcher={launcher}", *CPU, "batch_size=32,64", timeout=300)
    assert result.returncode == 0, result.output
    runs = _results(result)
    assert sorted(r["batch_size"] for r in runs) == [32, 64] and all(r["test_acc"] > 0.5 for r in runs)
    # the runs' table at the end, each run by what it was given (submitit's runs print into their own logs:
    # its console was blank to the end), and under submitit where their output is
    table = result.stdout[result.stdout.index(f"launch: under hydra/launcher={launcher}, 2 runs in multirun/"):]
    assert ": 2 finished\n" in table and "batch_size=32" in table and "batch_size=64" in table, table
    assert ("each run prints into multirun/" in result.stdout) == (launcher == "submitit_local"), result.stdout


def test_a_failed_run_under_another_launcher_fails_the_sweep(launch):
    result = launch("-m", "hydra/launcher=joblib", *CPU, "fault.rank=0,null", "fault.step=3", timeout=300)
    assert result.returncode == 1, result.output
    assert "launch: a sweep run failed: rank 0 failed: RuntimeError: injected failure" in result.stderr
    assert len(_results(result)) == 1  # the healthy run still trained


def test_backend_slurm_under_another_launcher_is_refused_before_anything_is_submitted(launch):
    result = launch("-m", "hydra/launcher=submitit_slurm", "backend=slurm", *CPU, "batch_size=32,64", timeout=60)
    assert result.returncode == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "backend=slurm is not valid with hydra/launcher=submitit_slurm" in lines[0]
    assert not (result.cwd / "multirun").exists()


def test_an_unknown_launcher_is_one_line(launch):
    result = launch("-m", "hydra/launcher=ray", *CPU, timeout=60)
    assert result.returncode == 2 and "hydra/launcher=ray is not valid: choose one of" in result.stderr
    assert "launch" in result.stderr and "Traceback" not in result.output


def test_optuna_optimizes_the_objective_each_run_returns(launch):
    result = launch("-m", "hydra/sweeper=optuna", "hydra.sweeper.n_trials=2", "hydra.sweeper.n_jobs=2",
                    "hydra.sweeper.direction=maximize", "lr=interval(0.01,0.1)", *CPU, timeout=300)
    assert result.returncode == 0, result.output
    runs = _results(result)
    assert len(runs) == 2
    best = yaml.safe_load(next(result.cwd.glob("multirun/*/*/optimization_results.yaml")).read_text())
    assert best["best_value"] == pytest.approx(max(r["test_acc"] for r in runs))  # sweep.objective: test_acc


def test_a_sweep_into_a_dir_that_holds_runs_is_refused_before_any_run_starts(launch):
    first = launch("-m", "hydra.sweep.dir=earlier", *CPU, "batch_size=32", timeout=120)
    assert first.returncode == 0, first.output
    before = (first.cwd / "earlier" / "0" / "results.json").read_text()
    again = launch("-m", "hydra.sweep.dir=earlier", *CPU, "batch_size=32,64", timeout=60)
    assert again.returncode == 2 and "already holds a run" in again.stderr and "started" not in again.stdout
    assert (first.cwd / "earlier" / "0" / "results.json").read_text() == before
    assert not (first.cwd / "earlier" / "1").exists()


def test_a_bad_run_fails_the_sweep_before_any_run_starts(launch):
    result = launch("-m", *CPU, "strategy=ddp", "nprocs=2", "batch_size=32,63", timeout=60)
    assert result.returncode == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "batch_size=63 is not valid" in lines[0] and "sweep run 1" in lines[0]
    assert not _results(result) and "started" not in result.stdout
    assert not (result.cwd / "multirun").exists(), list(result.cwd.glob("multirun/**/*"))  # nothing it made is left


@pytest.mark.parametrize(("launcher", "sig"), [("basic", "SIGINT"), ("basic", "SIGTERM"), ("joblib", "SIGINT")])
def test_ctrl_c_or_sigterm_stops_the_whole_sweep_under_another_launcher(tmp_path, launcher, sig):
    """Hydra's basic launcher runs the sweep's runs one after another in the launch process: a Ctrl-C (or
    SIGTERM) stopped the run it was in, and the next run started (the sweep went on for minutes). Under
    joblib, launch held the Ctrl-C it had taken while composing until the whole sweep ended."""
    import os
    import signal
    import time

    from tests.conftest import launch_command, start_as_terminal_job, stop_tree

    proc = start_as_terminal_job(launch_command("-m", f"hydra/launcher={launcher}", "gpus=[]", "epochs=100",
                                                "seed=1,2"), tmp_path)
    try:
        deadline = time.monotonic() + 120
        while not list(tmp_path.glob("multirun/*/*/0/metrics.jsonl")) and time.monotonic() < deadline:
            time.sleep(0.2)  # the first run is training
        signum = getattr(signal, sig)
        if sig == "SIGINT":
            os.killpg(proc.pid, signum)  # a terminal's Ctrl-C: the whole foreground group
        else:
            os.kill(proc.pid, signum)  # a scheduler's or a user's `kill`: the launch process alone
        out, err = proc.communicate(timeout=60)
    finally:
        stop_tree(proc.pid)
    assert proc.returncode == 128 + signum, (proc.returncode, err[-2000:])
    assert "Traceback" not in err and "Exception ignored" not in err, err[-2000:]
    assert not list(tmp_path.glob("multirun/*/*/1/results.json"))  # the second run did not run to its end
    if launcher == "basic":
        assert f"the sweep was stopped by {sig}; the runs after it were not started" in err, err[-2000:]

