"""`launch -m` on this host: runs side by side, then one summary (CPU runs here; the GPU packing itself
is tests/unit/test_sweep_packing.py, and on two GPUs tests/gpu/test_gpu.py)."""

import csv
import json

import pytest

pytestmark = pytest.mark.distributed


def test_a_three_point_sweep_runs_side_by_side_and_summarizes(launch):
    result = launch("-m", "recipe=digits", "gpus=[]", "epochs=2", "batch_size=32,64,128", "sweep.parallel=2",
                    timeout=300)
    assert result.returncode == 0, result.output
    out = result.stdout
    # two runs at once: the second starts before the first has finished
    assert out.index("sweep: job 1 started") < out.index("sweep: job 0 done")
    sweep_dir = next(result.cwd.glob("multirun/*/*/summary.csv")).parent
    with open(sweep_dir / "summary.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["overrides"].split()[-2] for r in rows] == ["batch_size=32", "batch_size=64", "batch_size=128"]
    assert all(r["exit_code"] == "0" and float(r["test_acc"]) > 0.8 and float(r["img_per_s"]) > 0 for r in rows)
    summary = (sweep_dir / "summary.md").read_text()
    assert summary.count("\n") == 7  # header, rule, 3 rows, and the best run after a blank line
    best = max(rows, key=lambda r: float(r["test_acc"]))
    assert f"\nbest: job {best['job']} (" in summary and summary.rstrip().endswith(f": {best['run_dir']}")
    assert (sweep_dir / "summary.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| job | swept |" in out and "| batch_size=64 |" in out and "summary.png" in out
    for job, batch in enumerate((32, 64, 128)):  # each run's own dir, output and results, with its own value
        assert (sweep_dir / str(job) / "launch.out").exists()
        assert json.loads((sweep_dir / str(job) / "results.json").read_text())["batch_size"] == batch


def test_a_failing_run_does_not_stop_the_others_and_fails_the_sweep(launch):
    # job 0 fails at its step 2; job 1's fault step lies beyond its run
    result = launch("-m", "recipe=digits", "gpus=[]", "epochs=1", "fault.rank=0", "fault.step=2,1000000",
                    timeout=300)
    assert result.returncode == 1, result.output
    assert "sweep: job 0 FAILED (exit 1)" in result.stderr and "sweep: job 1 done" in result.stdout
    assert "rank 0 failed: RuntimeError: injected failure" in result.stderr  # the run's own reason
    assert "1 of 2 sweep runs failed" in result.stderr
    assert len(list(result.cwd.glob("multirun/**/results.json"))) == 1  # the healthy run finished


def test_with_start_method_spawn_a_sweeps_run_is_a_fresh_interpreter(launch):
    """LAUNCH_START_METHOD=spawn: each run is `python -m launcher.host.sweep_job` (and each worker a fresh
    interpreter), for a setup where forking a process that has imported torch is not wanted."""
    from tests.conftest import clean_env

    result = launch("-m", "recipe=digits", "gpus=[]", "epochs=1", "lr=0.05", timeout=300,
                    env=clean_env(LAUNCH_START_METHOD="spawn"))
    assert result.returncode == 0, result.output
    assert "sweep: job 0 done" in result.stdout
    run_dir = next(result.cwd.glob("multirun/*/*/0"))
    assert "launch: done in" in (run_dir / "launch.out").read_text()
