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
