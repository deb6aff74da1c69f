"""Nothing outlives a launch, however it was started or killed; a local launch listens on loopback only."""

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.conftest import clean_env, descendants, is_loopback, launch_command, listening_sockets, stop_tree

pytestmark = pytest.mark.distributed

DDP_CPU = ("gpus=[]", "strategy=ddp", "nprocs=2")


def tagged(tag: str) -> set[int]:
    """Live processes whose environment carries LAUNCH_TEST_TAG=tag (a launch and all it started)."""
    found = set()
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if f"LAUNCH_TEST_TAG={tag}".encode() in environ.read_bytes().split(b"\0"):
                state = (environ.parent / "stat").read_text().rsplit(")", 1)[1].split()[0]
                if state != "Z":
                    found.add(int(environ.parent.name))
        except OSError:
            continue
    return found


def wait_for(predicate, within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return predicate()


def kill_tagged(tag: str) -> None:
    for pid in tagged(tag):
        stop_tree(pid)
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass


def kill_and_expect_nothing_left(proc: subprocess.Popen, tag: str, within: float) -> None:
    """kill -9 the launch `proc`; every process carrying `tag` must be gone within `within` seconds."""
    proc.kill()
    proc.wait(timeout=10)
    assert wait_for(lambda: not tagged(tag), within), f"left running: {tagged(tag)}"


def wait_for_workers(tag: str, how_many: int, within: float = 60) -> set[int]:
    assert wait_for(lambda: len(tagged(tag)) >= how_many, within), f"only {tagged(tag)} started"
    time.sleep(1.0)  # the workers are past their start-up
    return tagged(tag)


def test_launcher_killed_in_a_background_job_of_a_script_leaves_no_worker(tmp_path):
    """A shell script's background job inherits SIGINT ignored: torch's SIGINT parent-death signal
    cannot end the workers there. They must still die within seconds of a kill -9 of the launcher."""
    tag = f"bg-{os.getpid()}"
    command = " ".join(launch_command(*DDP_CPU, "epochs=500"))
    # A /tmp of its own: any other test's launch starting after the kill would remove the killed launch's folder
    # first (that is the behaviour under test, but it made the check below a race). Short: sockets live there.
    tmp = tempfile.mkdtemp(prefix="lk", dir="/tmp")
    env = clean_env(LAUNCH_TEST_TAG=tag, TMPDIR=tmp)
    started = subprocess.run(["bash", "-c", f"{command} > out.txt 2>&1 & echo $!"], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=30)
    launcher = int(started.stdout.strip())
    try:
        assert wait_for(lambda: "loss" in (tmp_path / "out.txt").read_text(), 90), \
            (tmp_path / "out.txt").read_text()
        before = tagged(tag)
        assert len(before - {launcher}) >= 2, before  # the workers (and the forkserver) are running
        own = Path(tmp) / f"launch-{os.getuid()}" / str(launcher)
        assert list(own.glob("pymp-*")), list(own.iterdir())  # (multiprocessing's socket folder: in launch's own)
        os.kill(launcher, 9)
        assert wait_for(lambda: not tagged(tag), 10), f"left running: {tagged(tag)}"
        # what kill -9 left in /tmp is launch's folder, which the next launch removes (its pid is gone)
        assert own.is_dir()
        nxt = subprocess.run([sys.executable, "-c", "from launcher.lifetime import private_temp_dir as p; print(p())"],
                             capture_output=True, text=True, timeout=60, env=clean_env(TMPDIR=tmp))
        assert nxt.returncode == 0 and nxt.stderr == "", nxt.stderr
        assert nxt.stdout.startswith(tmp)
        assert not own.exists() and not Path(nxt.stdout.strip()).exists()  # (and its own, at its exit)
    finally:
        kill_tagged(tag)
        shutil.rmtree(tmp, ignore_errors=True)


def _sweep_in_background(cwd: Path, tag: str, *args: str) -> subprocess.Popen:
    """`launch -m gpus=[] epochs=500 ARGS`, its output discarded, every process it starts carrying `tag`."""
    return subprocess.Popen(launch_command("-m", "gpus=[]", "epochs=500", *args), cwd=cwd, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env=clean_env(LAUNCH_TEST_TAG=tag))


def _wait_until_training(cwd: Path, trains) -> None:
    assert wait_for(trains, 90), list(cwd.glob("multirun/*/*/0/*"))


def test_a_sweep_killed_outright_leaves_no_run_server_run_or_worker(tmp_path):
    """`launch -m`: each run is a fork of the sweep's run server, not a child of launch (launcher/host/packing.py);
    a kill -9 of launch must still end the server, the run and the run's worker within seconds."""
    tag = f"sweep-{os.getpid()}"
    proc = _sweep_in_background(tmp_path, tag, "lr=0.05,0.1")
    try:
        _wait_until_training(tmp_path, lambda: any("loss" in out.read_text()
                                                   for out in tmp_path.glob("multirun/*/*/0/launch.out")))
        before = tagged(tag) - {proc.pid}
        assert len(before) >= 3, before  # the run server, the run, its worker
        kill_and_expect_nothing_left(proc, tag, within=15)
    finally:
        stop_tree(proc.pid)
        kill_tagged(tag)


@pytest.mark.parametrize("launcher", ["joblib", "submitit_local"])
def test_a_sweep_under_another_launcher_killed_outright_leaves_no_run_or_worker(tmp_path, launcher):
    """joblib runs a run in a loky worker that launch started, submitit_local in a child of its controller
    (launch's child): after a kill -9 of launch the run trained on to its end, and joblib's idle worker and
    resource tracker waited minutes for more. Now the run stops as at a `kill` and nothing is left."""
    tag = f"{launcher}-{os.getpid()}"
    extra = ["hydra.launcher.n_jobs=2"] if launcher == "joblib" else []  # (one run: one worker stays idle)
    proc = _sweep_in_background(tmp_path, tag, f"hydra/launcher={launcher}", *extra, "lr=0.05")
    try:
        _wait_until_training(tmp_path, lambda: list(tmp_path.glob("multirun/*/*/0/metrics.jsonl")))
        before = tagged(tag) - {proc.pid}
        assert len(before) >= 3, before  # the run's process, its worker, the launcher's helper (tracker, controller)
        kill_and_expect_nothing_left(proc, tag, within=15)
        # (joblib's shared-memory folders, named after launch's pid, removed by its resource tracker on its way out)
        assert not list(Path("/dev/shm").glob(f"joblib_memmapping_folder_{proc.pid}_*"))
        outcome = json.loads(next(tmp_path.glob("multirun/*/*/0/outcome.json")).read_text())
        assert outcome["exit_code"] == 128 + signal.SIGTERM, outcome  # stopped, as at a `kill`, and said so
    finally:
        stop_tree(proc.pid)
        kill_tagged(tag)


@contextlib.contextmanager
def sleeping_script(tmp_path, tag: str):
    """`launch script=train.py` on 2 CPU ranks that meet and then sleep, started cold and tagged `tag`; yields the
    launch process once both ranks said they are ready, and ends whatever of it is left afterwards."""
    (tmp_path / "train.py").write_text(
        "import time, torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        "print('rank', dist.get_rank(), 'ready', flush=True)\n"
        "time.sleep(300)\n")
    proc = subprocess.Popen(launch_command("script=train.py", "gpus=[]", "nprocs=2"), cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=clean_env(LAUNCH_TEST_TAG=tag))
    try:
        ready = 0
        for line in proc.stdout:
            ready += "ready" in line
            if ready == 2:
                break
        assert ready == 2
        yield proc
    finally:
        stop_tree(proc.pid)
        kill_tagged(tag)


def test_script_ranks_die_with_a_launcher_killed_outright(tmp_path):
    """elastic starts a script's ranks in sessions of their own; a kill -9 of the launcher must end them."""
    tag = f"script-{os.getpid()}"
    with sleeping_script(tmp_path, tag) as proc:
        ranks = tagged(tag) - {proc.pid}
        assert len(ranks) >= 2, ranks
        kill_and_expect_nothing_left(proc, tag, within=10)


def test_ctrl_c_of_a_script_ends_its_ranks_and_says_so_as_a_recipes_stop_does(tmp_path):
    """A new user's trial: a script's Ctrl-C said "stopped by signal 2", a recipe's "stopped by SIGINT"."""
    with sleeping_script(tmp_path, f"script-int-{os.getpid()}") as proc:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 130, out
        assert "launch: stopped by SIGINT: all ranks of train.py ended" in out, out


@pytest.mark.parametrize("mode", ["recipe", "script"])
def test_a_local_launch_listens_on_loopback_only(tmp_path, mode):
    """The rendezvous store, the workers' store (MASTER_PORT) and gloo's sockets: none on `*:port`."""
    (tmp_path / "train.py").write_text(
        "import time, torch, torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        "dist.all_reduce(torch.ones(1))\n"
        "print('ready', flush=True)\n"
        "time.sleep(300)\n")
    args = (*DDP_CPU, "epochs=500") if mode == "recipe" else ("script=train.py", "gpus=[]", "nprocs=2")
    tag = f"bind-{mode}-{os.getpid()}"
    proc = subprocess.Popen(launch_command(*args), cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=clean_env(LAUNCH_TEST_TAG=tag))
    try:
        for line in proc.stdout:
            if line.startswith("epoch") or "ready" in line:
                break
        sockets = listening_sockets({proc.pid} | descendants(proc.pid))
        assert sockets, "found no listening socket: the check would pass for the wrong reason"
        assert all(is_loopback(s) for s in sockets), f"listening beyond loopback: {sorted(sockets)}"
    finally:
        stop_tree(proc.pid)
        kill_tagged(tag)
