"""Supervision: a failing rank takes the launch down fast with the root cause named; signals leave no
process behind; restarts resume from the checkpoint; launches never collide."""

import json
import signal
import subprocess
import time
from contextlib import contextmanager

import pytest

from tests.conftest import alive, clean_env, descendants, launch_command, running, stop_tree

pytestmark = pytest.mark.distributed

DDP_CPU = ("gpus=[]", "strategy=ddp", "nprocs=2")


def test_rank_that_raises_brings_every_rank_down_with_its_traceback(launch):
    result = launch(*DDP_CPU, "epochs=50", "fault.rank=1", "fault.step=30")
    assert result.returncode == 1, result.output
    err = result.stderr
    assert "launch: rank 1 failed: RuntimeError: injected failure (fault.kind=raise) on rank 1 at step 30" in err
    assert "Traceback (most recent call last)" in err and "faults.py" in err
    assert "root cause: rank 1" in err
    assert "Connection closed by peer" not in err and "Connection reset" not in err  # no wall of echoes
    # every rank is down, and the launcher has exited, within 10 s of the failure
    records = {p.name: json.loads(p.read_text()) for p in (result.run_dir() / "failures").glob("*.json")}
    assert result.finished_at - records["attempt0-rank1.json"]["time"] < 10


def test_rank_killed_without_traceback_is_named(launch):
    result = launch(*DDP_CPU, "epochs=50", "fault.rank=1", "fault.step=30", "fault.kind=kill")
    assert result.returncode == 1
    assert "rank 1" in result.stderr and "without a Python traceback" in result.stderr


@contextmanager
def training_launch(tmp_path, sigint_ignored: bool = False):
    """A long 2-rank launch, yielded once its first epoch is done, with its worker pids. Always cleaned up.
    sigint_ignored: started as a shell script's background job is, with SIGINT ignored."""
    ignore = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if sigint_ignored else None
    proc = subprocess.Popen(launch_command(*DDP_CPU, "epochs=500"), cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=clean_env(), preexec_fn=ignore)
    try:
        for line in proc.stdout:
            if line.startswith("epoch"):
                break
        workers = descendants(proc.pid)
        assert len(workers) >= 2, workers
        yield proc, workers
    finally:
        stop_tree(proc.pid)


def assert_all_gone(pids, within: float = 10) -> None:
    deadline = time.monotonic() + within
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in pids if alive(p)], "orphaned worker processes"


@pytest.mark.parametrize("sig, ignored", [(signal.SIGINT, False), (signal.SIGTERM, False), (signal.SIGINT, True)],
                         ids=["SIGINT", "SIGTERM", "SIGINT-to-a-background-job"])
def test_signal_ends_every_worker_and_leaves_no_process(tmp_path, sig, ignored):
    """Every worker stops at once, well inside elastic's 5 s grace. A launch started with SIGINT ignored (a
    shell script's background job) passed that on to its workers, which trained on through the SIGINT the
    agent forwards until the grace ran out and they were killed, a checkpoint mid-write with them."""
    with training_launch(tmp_path, sigint_ignored=ignored) as (proc, workers):
        t = time.monotonic()
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 128 + sig, out
        assert f"stopped by {sig.name}" in out
        assert time.monotonic() - t < 4, out
        assert_all_gone(workers)


def test_launcher_killed_outright_leaves_no_worker(tmp_path):
    """SIGKILL gives the launcher no chance to clean up: the workers must still die with it."""
    with training_launch(tmp_path) as (proc, workers):
        proc.kill()
        proc.wait(timeout=10)
        assert_all_gone(workers, within=15)
        for p in workers:
            stop_tree(p)
        rest = proc.stdout.read()  # (to its end: every process that held the console has let go of it)
        # (multiprocessing's resource tracker, freeing the workers' semaphores, warned of them here)
        assert "Warning" not in rest and "Traceback" not in rest, rest


def _forkservers(pids) -> list[int]:
    return running(pids, b"multiprocessing.forkserver")


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_launcher_killed_while_its_worker_interpreter_imports_torch_leaves_nothing(tmp_path, sig):
    """Killed in its first second, while the forkserver it started imports torch for the workers: the
    forkserver and multiprocessing's resource tracker end with it, not seconds later when the imports
    are done (they kept writing to a console, or a pipe, that the user thought was closed)."""
    proc = subprocess.Popen(launch_command(*DDP_CPU, "epochs=5"), cwd=tmp_path, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env=clean_env())
    try:
        deadline = time.monotonic() + 30
        while not _forkservers(descendants(proc.pid)) and time.monotonic() < deadline:
            time.sleep(0.02)
        started = descendants(proc.pid)
        assert _forkservers(started), "no forkserver started"
        proc.send_signal(sig)
        proc.wait(timeout=10)
        assert_all_gone(started, within=1.0)
    finally:
        stop_tree(proc.pid)


def test_ctrl_c_while_the_worker_interpreter_imports_torch_is_one_line(tmp_path):
    """Ctrl-C at a terminal reaches the launcher and the forkserver it started (one process group): the
    forkserver, importing torch, printed a KeyboardInterrupt traceback from deep inside torch."""
    import os

    proc = subprocess.Popen(launch_command(*DDP_CPU, "epochs=5"), cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=clean_env(), start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # (as at a terminal)
    try:
        deadline = time.monotonic() + 30
        while not _forkservers(descendants(proc.pid)) and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.8)  # (inside its imports of torch: they take seconds)
        os.killpg(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    finally:
        stop_tree(proc.pid)
    assert proc.returncode == 130, out
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out
    assert out.strip().splitlines()[-1].startswith("launch: "), out


def test_restart_resumes_from_last_checkpoint(launch):
    steps_per_epoch = 1438 // 64
    result = launch(*DDP_CPU, "epochs=4", "max_restarts=1", "fault.rank=1", f"fault.step={2 * steps_per_epoch + 3}")
    assert result.returncode == 0, result.output
    results = result.results()
    assert results["restarts"] == 1 and results["resumed_from"].endswith("checkpoints/last.pt")
    rows = [json.loads(x) for x in (result.run_dir() / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in rows] == [1, 2, 3, 4]  # epochs 1-2 not trained again
    assert "resumed from" in result.stdout and "after epoch 2" in result.stdout


def test_a_restart_that_finds_its_checkpoint_damaged_goes_on_from_the_one_before(launch):
    """fault.kind=damage overwrites bytes inside last.pt (a failing disk) and fails the rank: the restart
    checks the checkpoint's seal, says it cannot be trusted, and trains on from previous.pt (epoch 1)."""
    steps_per_epoch = 1438 // 64
    result = launch("gpus=[]", "epochs=3", "max_restarts=1", "fault.rank=0", "fault.kind=damage",
                    f"fault.step={2 * steps_per_epoch + 12}")
    assert result.returncode == 0, result.output
    assert "last.pt cannot be trusted" in result.output and "going on from the one before it" in result.output
    results = result.results()
    assert results["restarts"] == 1 and results["resumed_from"].endswith("checkpoints/previous.pt")
    rows = [json.loads(x) for x in (result.run_dir() / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in rows] == [1, 2, 3]


def test_an_input_error_found_inside_a_worker_is_still_one_line(launch):
    result = launch(*DDP_CPU, "batch_size=5000")  # only the loaded dataset knows it has 1,438 images
    assert result.returncode == 2, result.output
    lines = [x for x in result.stderr.splitlines() if x.startswith("launch:")]
    assert lines == ["launch: batch_size=5000 is not valid: larger than the 1438 training images of digits "
                     "(e.g. launch batch_size=359)"], result.stderr
    assert "Traceback" not in result.output


def test_failure_on_every_attempt_reports_the_last_one(launch):
    result = launch(*DDP_CPU, "epochs=3", "max_restarts=1", "fault.rank=1", "fault.step=5", "fault.attempt=-1")
    assert result.returncode == 1, result.output
    assert "rank 1 failed after 1 restart: RuntimeError: injected failure" in result.stderr
    names = {p.name for p in (result.run_dir() / "failures").glob("*.json")}
    assert {"attempt0-rank1.json", "attempt1-rank1.json"} <= names


def test_a_hung_rank_ends_the_launch_within_the_collective_timeout(launch):
    """Rank 1 stops responding (alive, never reaching the next collective): rank 0's collective times out
    after strategy.timeout_s, and the launch ends naming rank 1 instead of waiting forever."""
    result = launch("gpus=[]", "strategy=ddp", "nprocs=2", "epochs=2", "fault.rank=1", "fault.step=5",
                    "fault.kind=hang", "strategy.timeout_s=5", timeout=120)
    assert result.returncode == 1, result.output
    assert "rank 1 stopped responding" in result.stderr and "strategy.timeout_s" in result.stderr
    assert result.seconds < 60


def test_out_of_memory_names_the_rank_the_batch_and_what_to_lower(launch):
    # fault.kind=oom raises the allocator's own exception (torch.OutOfMemoryError); a real one on a GPU
    # goes the same way (tests/gpu).
    result = launch("gpus=[]", "strategy=ddp", "nprocs=2", "epochs=2", "fault.rank=1", "fault.step=3",
                    "fault.kind=oom", timeout=120)
    assert result.returncode == 1, result.output
    err = result.stderr
    assert "out of memory on rank 1" in err and "batch_size=64 = 32 per rank" in err and "batch_size=32" in err
    assert "Traceback" not in err
