"""Whole runs as users chain them: resume, concurrent launches, sweeps, and joining a world that
torchrun or srun started."""

import json
import random
import shutil
import subprocess
import sys

import pytest

from tests.conftest import clean_env, launch_command

pytestmark = pytest.mark.distributed

DDP_CPU = ("gpus=[]", "strategy=ddp", "nprocs=2")


def test_resume_continues_a_finished_run_in_a_new_dir(launch):
    first = launch("epochs=2")
    assert first.returncode == 0
    old_dir = first.run_dir()
    second = launch("epochs=3", f"resume={old_dir}")
    assert second.returncode == 0, second.output
    new_dirs = [d for d in second.run_dirs() if d != old_dir]
    assert len(new_dirs) == 1
    rows = [json.loads(x) for x in (new_dirs[0] / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in rows] == [1, 2, 3]
    assert len((old_dir / "metrics.jsonl").read_text().splitlines()) == 2  # the old run is untouched


def test_two_launches_at_once_both_finish(launch, tmp_path):
    """Two ddp launches started together in one folder (forks of the warm launcher, within milliseconds of
    each other): each finds its own rendezvous port and run dir, and both train to the end."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        both = list(pool.map(lambda _: launch(*DDP_CPU, "epochs=2"), range(2)))
    assert [r.returncode for r in both] == [0, 0], [r.output for r in both]
    run_dirs = sorted(p.parent for p in tmp_path.glob("outputs/**/results.json"))
    assert len(run_dirs) == 2
    assert all(json.loads((d / "results.json").read_text())["ranks_agree"] for d in run_dirs)


def test_joins_a_world_started_by_torchrun(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "launcher", "gpus=[]", "epochs=2"]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=180, env=clean_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run_dirs = [p.parent for p in tmp_path.glob("outputs/**/results.json")]
    assert len(run_dirs) == 1 and run_dirs[0].name.startswith("torchrun-")
    results = json.loads((run_dirs[0] / "results.json").read_text())
    assert results["world_size"] == 2 and results["strategy"] == "ddp" and results["ranks_agree"]
    assert "joining an existing world" in proc.stdout


def test_joins_a_world_that_srun_started(tmp_path):
    """Two processes with the variables `srun --ntasks=2` gives its tasks (no SLURM daemon needed)."""
    job_id = str(random.randint(10_000, 99_999))  # the rendezvous port derives from it: vary it per run
    slurm = {"SLURM_JOB_ID": job_id, "SLURM_STEP_ID": "0", "SLURM_NTASKS": "2", "SLURM_STEP_NUM_TASKS": "2",
             "SLURM_JOB_NUM_NODES": "1",
             "SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "localhost"}
    procs = [subprocess.Popen(launch_command("gpus=[]", "epochs=2"), cwd=tmp_path, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True,
                              env=clean_env(**slurm, SLURM_PROCID=str(r), SLURM_LOCALID=str(r)))
             for r in range(2)]
    outs = [p.communicate(timeout=180)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    run_dirs = [p.parent for p in tmp_path.glob("outputs/**/results.json")]
    assert [d.name for d in run_dirs] == [f"slurm-{job_id}-0"]
    results = json.loads((run_dirs[0] / "results.json").read_text())
    assert results["world_size"] == 2 and results["ranks_agree"] and results["test_acc"] > 0.9


def test_resumed_run_matches_an_uninterrupted_one(launch):
    """Checkpoint + per-epoch seeding: stopping after epoch 2 and resuming gives the same weights."""
    whole = launch("epochs=3", "optim.warmup_epochs=0")
    assert whole.returncode == 0
    whole_digest = whole.results()["weights_sha256"]
    for d in whole.run_dirs():
        shutil.rmtree(d)  # so that resume=latest finds the interrupted run
    first = launch("epochs=3", "optim.warmup_epochs=0", "fault.rank=0", f"fault.step={2 * (1438 // 64)}")
    assert first.returncode == 1
    [interrupted] = first.run_dirs()
    second = launch("epochs=3", "optim.warmup_epochs=0", "resume=latest")
    assert second.returncode == 0, second.output
    [resumed] = [d for d in second.run_dirs() if (d / "results.json").exists()]
    results = json.loads((resumed / "results.json").read_text())
    assert results["weights_sha256"] == whole_digest
    # ...and it was a resume, not a deterministic run from scratch: it started from the checkpoint,
    # and epochs 1-2 are the interrupted run's own rows (their start times), not trained again
    assert results["resumed_from"] == str(interrupted / "checkpoints" / "last.pt")
    metrics = [(d / "metrics.jsonl").read_text().splitlines() for d in (interrupted, resumed)]
    assert len(metrics[1]) == 3 and metrics[1][:2] == metrics[0][:2]


def test_a_finished_run_dir_is_never_written_over(launch):
    first = launch("epochs=1")
    assert first.returncode == 0
    run_dir = first.run_dir()
    before = (run_dir / "metrics.jsonl").read_text()
    again = launch("epochs=1", f"hydra.run.dir={run_dir}")
    assert again.returncode == 2 and "already holds a run" in again.stderr
    assert (run_dir / "metrics.jsonl").read_text() == before


def test_a_launch_keeps_torchs_bytecode_in_its_cache_and_not_beside_the_sources(launch, tmp_path):
    cache = tmp_path / "pycache"
    env = clean_env(LAUNCH_PYCACHE="1", LAUNCH_PYCACHE_DIR=str(cache), PYTHONDONTWRITEBYTECODE="1")
    first = launch(*DDP_CPU, "epochs=1", env=env)
    assert first.returncode == 0, first.output
    assert f"keeping it under {cache}" in first.stderr
    # written by the launcher and by the process the workers fork from (torch._dynamo is only imported there)
    assert list(cache.glob("**/torch/__init__.*.pyc"))
    assert list(cache.glob("**/torch/_dynamo/*.pyc"))
    second = launch(*DDP_CPU, "epochs=1", "dry_run=true", env=env)  # (decided as any launch is, before its plan)
    assert second.returncode == 0 and "keeping it under" not in second.stderr  # said once
