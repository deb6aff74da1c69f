"""What the console shows: a live bar on a terminal, one line per epoch anywhere else (CI, SLURM logs)."""

import fcntl
import os
import pty
import select
import struct
import subprocess
import sys
import termios

import pytest

from tests.conftest import clean_env

pytestmark = pytest.mark.distributed

RUN = ("recipe=digits", "gpus=[]", "strategy=ddp", "nprocs=2", "epochs=3")


def test_output_to_a_pipe_is_one_line_per_epoch(launch):
    result = launch(*RUN)
    assert result.returncode == 0, result.output
    assert "\r" not in result.output and "run ETA" not in result.output  # no bar redraws in logs
    epoch_lines = [line for line in result.stdout.splitlines() if line.startswith("epoch ")]
    assert len(epoch_lines) == 3 and all("loss" in x and "img/s" in x and "test" in x for x in epoch_lines)


def _on_a_terminal(tmp_path, columns: int, *args: str) -> tuple[int, str]:
    """Run launch on a pseudo-terminal `columns` wide; (exit code, everything it drew)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))
    env = clean_env()
    env.pop("COLUMNS", None)
    proc = subprocess.Popen([sys.executable, "-m", "launcher", *args], cwd=tmp_path,
                            stdin=slave, stdout=slave, stderr=slave, env=env, close_fds=True)
    os.close(slave)
    seen = b""
    while True:
        ready, _, _ = select.select([master], [], [], 120)
        if not ready:
            break
        try:
            chunk = os.read(master, 65536)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        seen += chunk
    return proc.wait(timeout=120), seen.decode(errors="replace")


def test_a_terminal_gets_the_live_bar_fitted_to_its_width(tmp_path):
    """60 columns: the figures that matter (img/s, the run's ETA) stay, the line never wraps."""
    code, text = _on_a_terminal(tmp_path, 60, *RUN[:-1], "epochs=12")
    assert code == 0, text[-2000:]
    drawn = [seg for line in text.split("\n") for seg in line.split("\r")
             if seg.startswith("epoch ") and " step " in seg]
    assert drawn, text[-2000:]
    plain = [seg.replace("\x1b[A", "").replace("\x1b[K", "").rstrip() for seg in drawn]
    assert max(len(seg) for seg in plain) < 60, max(plain, key=len)  # never the last column: no wrapping
    assert any("img/s" in seg and "run ETA" in seg for seg in plain), plain[-5:]
    assert any(seg.startswith("epoch 2/12 step") for seg in plain)
    assert "epoch 12/12  loss" in text  # the per-epoch lines are still there
