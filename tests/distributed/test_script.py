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
