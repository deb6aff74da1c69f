"""`launch ... backend=slurm` against a real slurmctld/slurmd/slurmdbd (CPU, gloo), as a user submits."""

import json
import subprocess

import pytest

from tests.conftest import clean_env

pytestmark = pytest.mark.slurm

DDP_CPU = ("recipe=digits", "gpus=[]", "strategy=ddp", "nprocs=2", "backend=slurm", "backend.wait=true")


def _job_field(conf: str, job_id: str, field: str) -> str:
    shown = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True,
                           env=clean_env(SLURM_CONF=conf), check=True).stdout
    return shown.split(f"{field}=", 1)[1].split("\n", 1)[0].rstrip()


def test_two_task_ddp_job_trains_like_a_local_run(launch, slurm_cluster):
    result = launch(*DDP_CPU, "backend.job_name='my run'", """+backend.additional.comment='it\\'s "ours"'""",
                    env=clean_env(SLURM_CONF=slurm_cluster), timeout=300)
    assert result.returncode == 0, result.output
    assert "submitted SLURM job" in result.stdout and "finished" in result.stdout
    r = result.results()
    assert r["strategy"] == "ddp" and r["world_size"] == 2 and r["ranks_agree"]
    assert r["test_acc"] >= 0.95, r  # the bar of the local 2-rank test (tests/distributed/test_ddp_digits.py)
    job = json.loads((result.run_dir() / "slurm.json").read_text())
    # the values with a space and quotes reached SLURM whole, not split or interpreted
    assert _job_field(slurm_cluster, job["job_id"], "JobName") == "my run"
    assert _job_field(slurm_cluster, job["job_id"], "Comment") == 'it\'s "ours"'
    assert "[rank 0]" in (result.run_dir() / "train.log").read_text()


def test_a_failing_rank_fails_the_job_and_the_launch(launch, slurm_cluster):
    result = launch(*DDP_CPU, "fault.rank=1", "fault.step=3", env=clean_env(SLURM_CONF=slurm_cluster), timeout=300)
    assert result.returncode == 1, result.output
    assert "SLURM job" in result.stderr and "ended FAILED" in result.stderr
    assert "rank 1 failed: RuntimeError: injected failure" in result.stderr  # the root cause, not srun's echo


def test_without_waiting_the_job_id_and_paths_come_back_at_once(launch, slurm_cluster):
    result = launch("recipe=digits", "gpus=[]", "epochs=1", "backend=slurm", env=clean_env(SLURM_CONF=slurm_cluster))
    assert result.returncode == 0, result.output
    job_id = json.loads((result.run_dir() / "slurm.json").read_text())["job_id"]
    assert f"submitted SLURM job {job_id}" in result.stdout and "run dir" in result.stdout
    subprocess.run(["scancel", job_id], env=clean_env(SLURM_CONF=slurm_cluster), check=False)
