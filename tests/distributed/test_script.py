"""`launch script=...`: a user's unmodified torchrun-style script on 2 gloo ranks, supervised like a recipe."""

import csv
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import clean_env

pytestmark = pytest.mark.distributed

SCRIPT = Path(__file__).parent / "data" / "torchrun_style_script.py"
CPU2 = ("gpus=[]", "strategy=ddp", "nprocs=2")


def test_the_script_runs_on_two_ranks_with_its_arguments(launch):
    result = launch(f"script={SCRIPT}", *CPU2, "+args.name=hello", "--", "--steps", "2")
    assert result.returncode == 0, result.output
    # both ranks' output reaches the user, prefixed; the arguments got there (sum of 1+2 twice reduced = 6)
    assert "[rank0]:rank 0 of 2 local 0 name=hello sum=6.0" in result.stdout
    assert "[rank1]:rank 1 of 2 local 1 name=hello sum=6.0" in result.stdout
    run_dir = result.run_dir()
    assert (run_dir / "logs").is_dir() and (run_dir / "plan.json").exists()
    assert "-torchrun_style_script-" in run_dir.name and "digits" not in run_dir.name  # named after the script
    assert "finished on every rank" in result.output


def test_under_torchrun_each_rank_runs_the_script_in_its_own_process(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "launcher",
           f"script={SCRIPT}", "gpus=[]", "--", "--steps", "2", "--fail-rank", "1"]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=180, env=clean_env())
    assert "rank 0 of 2 local 0 name=x sum=6.0" in proc.stdout and "rank 1 of 2 local 1 name=x sum=6.0" in proc.stdout
    assert proc.returncode != 0 and "rank 1: torchrun_style_script.py exited with code 3" in proc.stderr


def test_a_failing_rank_stops_the_script_with_its_exit_code(launch):
    result = launch(f"script={SCRIPT}", *CPU2, "--", "--fail-rank", "1")
    assert result.returncode == 3, result.output
    assert "rank 1 of torchrun_style_script.py exited with code 3" in result.stderr


def test_a_rank_that_raises_is_named_with_its_error_not_the_echo_on_its_peers(launch):
    """The line names the rank that raised and what it raised (read from its stderr log: a script without
    torch's @record leaves no error file), not "exited with code 1", nor the gloo error its peer got."""
    result = launch(f"script={SCRIPT}", *CPU2, "--", "--raise-rank", "1")
    assert result.returncode == 1, result.output
    # (the rank exits 1, or, its gloo group alive at exit, aborts after the traceback: both say what it raised)
    said = [line for line in result.stderr.splitlines() if line.startswith("launch: rank 1 of torchrun_style_script")]
    assert said and ("exited with code 1: ValueError: a bad batch on rank 1." in said[0]
                     or "raised ValueError: a bad batch on rank 1 (then aborted at exit" in said[0]), result.stderr


def test_a_rank_that_raised_then_aborted_at_exit_is_named_with_what_it_raised(tmp_path):
    """A script that raises leaves its gloo group alive; at exit that can abort the process (SIGABRT), and
    elastic's record says only "Signal 6 (SIGABRT) received": the line said "killed by signal 6" (CI, 2026-11-30)."""
    from types import SimpleNamespace

    from launcher.host.script import _describe

    logs = tmp_path / "logs"
    folder = logs / "launch-x" / "attempt_0" / "1"
    folder.mkdir(parents=True)
    (folder / "stderr.log").write_text("[rank1]: Traceback (most recent call last):\n"
                                       "[rank1]:   File \"train.py\", line 7, in <module>\n"
                                       "[rank1]: ValueError: a bad batch\n"
                                       "terminate called without an active exception\n")
    failures = {1: SimpleNamespace(local_rank=1, timestamp=1700000000, exitcode=-6,
                                   message="Signal 6 (SIGABRT) received by PID 11836")}
    err = SimpleNamespace(failures=failures, get_first_failure=lambda: (1, failures[1]))
    outcome = _describe(err, Path("train.py"), logs)
    assert outcome.exit_code == 1 and outcome.error.startswith("rank 1 of train.py raised ValueError: a bad batch "
                                                               "(then aborted at exit"), outcome
    # an abort long after an error the script printed and went on from is not blamed on that error
    (folder / "stderr.log").write_text("[rank1]: Traceback (most recent call last):\n[rank1]: KeyError: 'x'\n"
                                       + "".join(f"[rank1]: step {i}\n" for i in range(30))
                                       + "terminate called without an active exception\n")
    assert _describe(err, Path("train.py"), logs).error.startswith("rank 1 of train.py was killed by signal 6"), \
        _describe(err, Path("train.py"), logs)
    # an abort with no traceback before it is still said as the signal it was
    (folder / "stderr.log").write_text("terminate called without an active exception\n")
    assert _describe(err, Path("train.py"), logs).error.startswith("rank 1 of train.py was killed by signal 6: "
                                                                    "Signal 6 (SIGABRT)")


def test_of_ranks_failed_together_the_one_whose_error_is_its_own_is_named(tmp_path):
    """elastic's first failure is by whole seconds where no error file was written: rank 0's echo of rank
    1's death tied with it and was named, with gloo's message."""
    from types import SimpleNamespace

    from launcher.host.script import _describe

    logs = tmp_path / "logs"
    for local, last in ((0, "RuntimeError: [../gloo/transport/tcp/pair.cc:561] Connection closed by peer "
                            "[127.0.0.1]:8095"), (1, "ValueError: a bad batch")):
        folder = logs / "launch-x" / "attempt_0" / str(local)
        folder.mkdir(parents=True)
        (folder / "stderr.log").write_text(f"[rank{local}]: Traceback (most recent call last):\n"
                                           f"[rank{local}]:   File \"train.py\", line 7, in <module>\n"
                                           f"[rank{local}]: {last}\n")
    failures = {r: SimpleNamespace(local_rank=r, timestamp=1700000000, exitcode=1, message=None) for r in (0, 1)}
    err = SimpleNamespace(failures=failures, get_first_failure=lambda: (0, failures[0]))
    said = _describe(err, Path("train.py"), logs).error
    assert said.startswith("rank 1 of train.py exited with code 1: ValueError: a bad batch."), said


def test_a_rank_that_exited_with_a_code_is_named_before_a_peer_elastic_stopped_with_sigterm(tmp_path):
    """Under load rank 0 was still exiting when rank 1's exit 3 was seen, so elastic's SIGTERM caught it; tied
    to the second, rank 0 came first and the launch said "killed by signal 15" and exited 1, not 3."""
    from types import SimpleNamespace

    from launcher.host.script import _describe

    failures = {0: SimpleNamespace(local_rank=0, timestamp=1700000000, exitcode=-15,
                                   message="Signal 15 (SIGTERM) received by PID 14772"),
                1: SimpleNamespace(local_rank=1, timestamp=1700000000, exitcode=3, message=None)}
    err = SimpleNamespace(failures=failures, get_first_failure=lambda: (0, failures[0]))
    outcome = _describe(err, Path("train.py"), tmp_path / "logs")
    assert outcome.exit_code == 3 and outcome.error.startswith("rank 1 of train.py exited with code 3"), outcome
    # a rank the kernel killed (SIGKILL: out of memory) comes before the peers elastic stopped with SIGTERM
    failures[1] = SimpleNamespace(local_rank=1, timestamp=1700000001, exitcode=-9, message="Signal 9 (SIGKILL)")
    assert _describe(err, Path("train.py"), tmp_path / "logs").error.startswith("rank 1 of train.py was killed by "
                                                                                 "signal 9")


def test_a_missing_script_is_one_line(launch):
    result = launch("script=nope.py", *CPU2)
    assert result.returncode == 2
    assert result.stderr.strip().startswith("launch: script=nope.py is not valid: no such file")


def test_a_missing_script_is_refused_before_a_slurm_job_is_submitted(launch):
    result = launch("script=nope.py", "backend=slurm", *CPU2)  # no SLURM needed: nothing is submitted
    assert result.returncode == 2
    assert result.stderr.strip().startswith("launch: script=nope.py is not valid: no such file")
    assert not list(result.cwd.glob("outputs/**/.submitit"))


def test_a_sweep_over_the_scripts_arguments(launch):
    result = launch("-m", f"script={SCRIPT}", *CPU2, "+args.name=a,b", timeout=300)
    assert result.returncode == 0, result.output
    with open(next(result.cwd.glob("multirun/*/*/summary.csv"))) as f:
        rows = list(csv.DictReader(f))
    assert [r["exit_code"] for r in rows] == ["0", "0"] and "+args.name=b" in rows[1]["overrides"]
