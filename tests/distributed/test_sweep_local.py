"""`launch -m` on this host: runs side by side, then one summary (CPU runs here; the GPU packing itself
is tests/unit/test_sweep_packing.py, and on two GPUs tests/gpu/test_gpu.py)."""

import csv
import json
import subprocess
import time
from pathlib import Path

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
    assert (sweep_dir / "summary.md").read_text().count("\n") == 5  # header, rule, 3 rows
    assert (sweep_dir / "summary.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| job | overrides |" in out and "summary.png" in out
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


def _ppid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _runs_seen(launch_pid: int) -> dict[str, tuple[int, int, bytes, dict[int, int]]]:
    """The sweep runs alive below `launch_pid`, by name (`launch job N`; its workers, forks of it, show the
    same name): (its pid, its parent's pid, its parent's command line, {pid: parent pid} of the run's own
    descendants)."""
    from tests.conftest import descendants

    seen = {}
    for pid in descendants(launch_pid):
        try:
            name = Path(f"/proc/{pid}/comm").read_text().strip()
            parent = _ppid(pid)
            if name.startswith("launch job ") and Path(f"/proc/{parent}/comm").read_text().strip() != name:
                below = {p: _ppid(p) for p in descendants(pid)}
                seen[name] = (pid, parent, Path(f"/proc/{parent}/cmdline").read_bytes(), below)
        except (OSError, IndexError):
            continue
    return seen


def test_a_sweeps_runs_are_forks_of_one_run_server_not_fresh_interpreters(tmp_path, request):
    """Each run of a local sweep is a fork of one process that has imported torch, Hydra and the launch
    command (launcher/host/packing.py), and its workers are forks of the run: no run imports them again or
    starts a forkserver of its own (seconds of every run's start on a GPU host). A fresh `launch`, as a user
    starts it (the warm launcher's forks already start their workers by fork)."""
    from tests.conftest import clean_env, launch_command, stop_tree

    proc = subprocess.Popen(launch_command("-m", "recipe=digits", "gpus=[]", "epochs=8", "lr=0.05,0.1"),
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env())
    request.addfinalizer(lambda: stop_tree(proc.pid))
    seen: dict[str, tuple[int, int, bytes, dict[int, int]]] = {}
    deadline = time.monotonic() + 240
    while proc.poll() is None and time.monotonic() < deadline:
        for name, facts in _runs_seen(proc.pid).items():
            if name not in seen or len(facts[3]) > len(seen[name][3]):
                seen[name] = facts
        time.sleep(0.02)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, out + err
    assert sorted(seen) == ["launch job 0", "launch job 1"], seen
    servers = {(parent, cmdline) for _, parent, cmdline, _ in seen.values()}
    assert len(servers) == 1, servers  # one server for every run
    [(server, cmdline)] = servers
    assert server != proc.pid and b"multiprocessing.forkserver" in cmdline, cmdline
    for name, (run, _, _, below) in seen.items():
        assert below, f"{name}: no worker seen"
        # every process below the run is its own child (a forkserver of the run's would stand between)
        assert set(below.values()) == {run}, (name, run, below)
    assert "sweep: job 1 done" in out


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
