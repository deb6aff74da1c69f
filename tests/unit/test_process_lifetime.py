"""launcher/lifetime.py and launcher/logs.py in this process: which processes count as alive, which private
temporary folders a launch removes, and who speaks on the console."""

from __future__ import annotations

import logging
import os
import subprocess
import tempfile
import time

from launcher import lifetime, logs


def test_a_zombie_is_not_alive_and_a_running_process_is():
    child = subprocess.Popen(["true"])
    try:
        while open(f"/proc/{child.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
            time.sleep(0.01)  # (until it has exited, not yet reaped: a zombie)
        assert not lifetime.process_alive(child.pid)
        assert lifetime.process_alive(os.getpid())
    finally:
        child.wait()
    assert not lifetime.process_alive(child.pid)


def test_a_run_ends_with_launch_only_where_launch_is_its_ancestor():
    """end_with arms on an ancestor and on nothing else: a pid that is not one (launch's pid as seen by a job on
    a SLURM node, where it names another machine's process or none) must not stop the run when it ends."""
    script = ("import os, signal, subprocess, sys, time\n"
              "from launcher import lifetime\n"
              "signal.signal(signal.SIGTERM, lambda *a: (print('signalled', flush=True), os._exit(0)))\n"
              "other = subprocess.Popen(['sleep', '0.5'])\n"
              "print('other', lifetime.end_with(other.pid), flush=True)\n"
              "other.wait(); time.sleep(0.5)\n"
              "print('parent', lifetime.end_with(os.getppid()) is not None, flush=True)\n"
              "time.sleep(30)\n")
    parent = subprocess.Popen(["bash", "-c", f'python -c "{script}" & sleep 4'], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PATH": f"{os.path.dirname(os.sys.executable)}:{os.environ['PATH']}"})
    out, _ = parent.communicate(timeout=60)
    # (once bash, the parent, has ended after 4 s, the child is signalled: it prints and exits)
    assert out.split() == ["other", "None", "parent", "True", "signalled"], out


def test_a_launch_removes_the_private_temporary_folders_of_dead_launches_only(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", tempfile.tempdir)
    base = tmp_path / f"launch-{os.getuid()}"
    dead = subprocess.Popen(["true"])
    dead.wait()
    alive = subprocess.Popen(["sleep", "60"])
    try:
        for pid in (dead.pid, alive.pid):
            (base / str(pid)).mkdir(parents=True, mode=0o700)
            (base / str(pid) / lifetime.NAMESPACE).write_text(lifetime._pid_namespace())
        base.chmod(0o700)
        mine = lifetime.private_temp_dir()
        assert mine == str(base / str(os.getpid())) and tempfile.tempdir == mine
        assert not (base / str(dead.pid)).exists() and (base / str(alive.pid)).is_dir()
    finally:
        alive.kill()
        alive.wait()


def test_only_rank_0_speaks_on_the_console_below_a_warning(tmp_path, capsys):
    try:
        logs.setup_worker_logging(tmp_path, rank=1)
        logging.getLogger("launcher.test").info("epoch 1 done")
        logging.getLogger("launcher.test").warning("slow input")
        out, err = capsys.readouterr()
        assert "epoch 1 done" not in out + err and "[rank 1] WARNING slow input" in err
        assert "epoch 1 done" in (tmp_path / "train.log").read_text()  # (every rank's lines in the file)
    finally:
        logs._reset_root()


def test_a_line_meant_for_the_file_only_stays_off_the_console(tmp_path, capsys):
    try:
        logs.setup_launcher_logging(tmp_path)
        logging.getLogger("launcher").info("every rank's detail", extra={"file_only": True})
        logging.getLogger("launcher").info("the summary")
        out = capsys.readouterr().out
        assert "launch: the summary" in out and "detail" not in out
        assert "every rank's detail" in (tmp_path / "train.log").read_text()
    finally:
        logs._reset_root()


_CTRL_C_IN_A_WEAKREF_CALLBACK = """
import os, signal, sys, time, weakref

from launcher.train.worker import worker_main  # (imported as a worker's process has it)

if sys.argv[1] in ("worker", "slow"):
    from launcher.lifetime import never_lose_ctrl_c

    never_lose_ctrl_c()  # what worker_main and launch's own processes call first
if sys.argv[1] == "slow":  # the main thread held up in the hook after it started the thread (a loaded machine)
    import threading

    started = threading.Thread.start

    def start_slowly(self):
        started(self)
        time.sleep(0.3)

    threading.Thread.start = start_slowly


class Thing:
    pass


def freed(ref):  # a Ctrl-C that Python runs the handler for inside a weakref callback
    os.kill(os.getpid(), signal.SIGINT)
    sum(range(1000))


thing = Thing()
ref = weakref.ref(thing, freed)
try:
    del thing
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:  # (a worker's training)
        pass
    print("went on")
except KeyboardInterrupt:
    print("interrupted")
"""


def test_a_ctrl_c_landing_in_a_weakref_callback_is_neither_printed_nor_lost():
    """CI's joblib sweep stopped by Ctrl-C printed "Exception ignored in: <function WeakSet.__init__.<locals>
    ._remove> ... KeyboardInterrupt": Python had run the SIGINT handler inside a weakref callback, where the
    exception cannot propagate, and the process went on as if no key had been pressed. As plain Python does
    that (checked here too, so that this test reproduces it); with never_lose_ctrl_c the Ctrl-C is raised."""
    import sys

    def run(mode: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", _CTRL_C_IN_A_WEAKREF_CALLBACK, mode], capture_output=True,
                              text=True, timeout=60, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))

    plain = run("plain")
    assert plain.stdout.strip() == "went on" and "Exception ignored" in plain.stderr, plain.stdout + plain.stderr
    held = run("worker")
    assert held.stdout.strip() == "interrupted" and held.stderr == "", held.stdout + held.stderr
    slow = run("slow")  # (CI under load: the SIGINT sent again came while the hook still ran, and was lost)
    assert slow.stdout.strip() == "interrupted" and slow.stderr == "", slow.stdout + slow.stderr


def test_every_process_of_a_launch_that_takes_ctrl_c_keeps_it_from_being_lost():
    """never_lose_ctrl_c where a terminal's Ctrl-C lands: launch itself, a run in another Hydra launcher's
    process, and every training worker (read from the code that starts each: their hooks are process-wide)."""
    import inspect

    from launcher.host import cli
    from launcher.train import worker

    assert "never_lose_ctrl_c()" in inspect.getsource(worker.worker_main)
    assert "never_lose_ctrl_c()" in inspect.getsource(cli.main)
    assert "never_lose_ctrl_c()" in inspect.getsource(cli.Invocation.run_job)


def test_a_process_name_holds_no_space_for_tools_that_read_proc_stat_as_words():
    """SLURM's proctrack/linuxproc reads /proc/<pid>/stat's name as one word: with ranks named "launch rank 0" it
    misread their parents, and `scancel --signal=USR2` (a preemption) never reached them: nothing requeued."""
    import sys

    child = subprocess.run([sys.executable, "-c", "from launcher import lifetime\n"
                            "lifetime.name_this_process('launch rank 12')\n"
                            "print(open('/proc/self/comm').read().strip(), open('/proc/self/stat').read().split()[1])"],
                           capture_output=True, text=True, timeout=60)
    assert child.stdout.split() == ["launch-rank-12", "(launch-rank-12)"], child.stdout + child.stderr


_STOPPED_WHILE_WRITING = """
import os, sys, threading, time

import torch

from launcher.lifetime import finish_on_sigterm
from launcher.train import checkpoint

finish_on_sigterm()  # as worker_main does
slow = checkpoint.save_snapshot


def save_slowly(snapshot, path, *rest):  # a write that takes a second (a large state, a slow disk)
    time.sleep(1.0)
    slow(snapshot, path, *rest)


checkpoint.save_snapshot = save_slowly
writer = checkpoint.BackgroundWriter()
if sys.argv[2] == "write":
    writer.submit(checkpoint.HostSnapshot({"w": torch.arange(1000.0)}), checkpoint.Path(sys.argv[1]))
elif os.fork() == 0:  # a process this one forks (a DataLoader worker): SIGTERM's default action there
    from launcher.lifetime import die_with_parent

    die_with_parent()  # (SIGKILL with its parent: a failing test leaves no process behind)
    os.write(1, f"{os.getpid()}\\n".encode())  # (one write: the parent's line cannot land inside it)
    threading.Event().wait()
os.write(1, b"ready\\n")
threading.Event().wait()  # (the main thread stuck, as in a collective whose peer died)
"""


def _stopped(tmp_path, what: str) -> tuple[subprocess.Popen, list[str]]:
    import sys

    proc = subprocess.Popen([sys.executable, "-c", _STOPPED_WHILE_WRITING, str(tmp_path / "last.pt"), what],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    return proc, [proc.stdout.readline().strip() for _ in range(1 if what == "write" else 2)]


def test_a_worker_stopped_by_sigterm_finishes_the_checkpoint_it_was_writing_first(tmp_path):
    """A rank whose peer failed is stopped by elastic's SIGTERM: a checkpoint being written on its writer thread
    was lost with it (SIGTERM's default action), and the restart resumed from the one before (CI: a failure one
    step after a mid-epoch checkpoint went back to the epoch's start). The write is finished first, within
    elastic's grace, then the process ends (128+15)."""
    import signal

    import torch

    proc, lines = _stopped(tmp_path, "write")
    try:
        assert lines == ["ready"], proc.stderr.read()
        t = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 128 + signal.SIGTERM, proc.stderr.read()
        assert 0.5 < time.monotonic() - t < 4.5
    finally:
        proc.kill()
        proc.wait()
    assert torch.equal(torch.load(tmp_path / "last.pt", weights_only=True)["w"], torch.arange(1000.0))


def test_sigterm_ends_a_worker_with_nothing_to_finish_at_once_and_its_forked_children_as_before(tmp_path):
    """With no write in flight SIGTERM ends a worker at once, though its main thread is stuck; a process it
    forked (a DataLoader worker) has SIGTERM's default action (the worker's handler there would wait for
    writes that no thread of the child makes)."""
    import signal

    proc, lines = _stopped(tmp_path, "fork")
    child = int(next(line for line in lines if line.isdigit()))
    try:
        t = time.monotonic()
        os.kill(child, signal.SIGTERM)  # (its exit status is its parent's to read: watched in /proc)
        while lifetime.process_alive(child) and time.monotonic() - t < 5:
            time.sleep(0.02)
        assert not lifetime.process_alive(child) and time.monotonic() - t < 1.0
        time.sleep(0.3)
        assert proc.poll() is None  # (the child's signal is its own: its parent trains on)
        t = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 128 + signal.SIGTERM and time.monotonic() - t < 1.0
    finally:
        proc.kill()
        proc.wait()
