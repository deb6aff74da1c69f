"""`launch ... backend=slurm` against a real slurmctld/slurmd/slurmdbd (CPU, gloo), as a user submits."""

import csv
import json
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import clean_env

pytestmark = pytest.mark.slurm

DDP_CPU = ("recipe=digits", "gpus=[]", "strategy=ddp", "nprocs=2", "backend=slurm", "backend.wait=true")


def _job_field(conf: str, job_id: str, field: str, rest_of_line: bool = False) -> str:
    """A field of `scontrol show job`: its first word, or (JobName, Comment: may hold spaces) the line's rest."""
    shown = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True,
                           env=clean_env(SLURM_CONF=conf), check=True).stdout
    value = shown.split(f" {field}=", 1)[1].split("\n", 1)[0].rstrip()
    return value if rest_of_line else value.split()[0]


def test_a_two_node_job_trains_with_ranks_on_both_nodes_that_agree(launch, slurm_cluster):
    """backend.nodes=2, 2 tasks on each: srun starts the 4 ranks on lnode1 and lnode2 (each its own
    network namespace and host name), the ranks meet at the first node over gloo, rank 0 writes the run."""
    result = launch(*DDP_CPU, "backend.nodes=2", "epochs=2", "backend.job_name='my run'",
                    """+backend.additional.comment='it\\'s "ours"'""", env=clean_env(SLURM_CONF=slurm_cluster),
                    timeout=300)
    assert result.returncode == 0, result.output
    assert "submitted SLURM job" in result.stdout and "4 tasks on 2 nodes" in result.stdout
    assert "finished" in result.stdout
    r = result.results()
    assert r["strategy"] == "ddp" and r["world_size"] == 4 and r["ranks_agree"] and len(r["weights_sha256"]) == 4
    assert r["hosts"] == ["lnode1", "lnode1", "lnode2", "lnode2"], r["hosts"]
    assert r["test_acc"] >= 0.95  # the bar of the local 2-rank test (tests/distributed/test_ddp_digits.py)
    job = json.loads((result.run_dir() / "slurm.json").read_text())
    # the values with a space and quotes reached SLURM whole, not split or interpreted
    assert _job_field(slurm_cluster, job["job_id"], "JobName", rest_of_line=True) == "my run"
    assert _job_field(slurm_cluster, job["job_id"], "Comment", rest_of_line=True) == 'it\'s "ours"'
    assert "[rank 0]" in (result.run_dir() / "train.log").read_text()


def test_a_failing_rank_fails_the_job_and_the_launch(launch, slurm_cluster):
    # (rank 1 is on the second node: its exception is named on the first, from the shared run dir)
    result = launch(*DDP_CPU[:3], "nprocs=1", *DDP_CPU[4:], "backend.nodes=2", "fault.rank=1", "fault.step=3",
                    env=clean_env(SLURM_CONF=slurm_cluster), timeout=300)
    assert result.returncode == 1, result.output
    assert "SLURM job" in result.stderr and "ended FAILED" in result.stderr
    assert "rank 1 failed: RuntimeError: injected failure" in result.stderr  # the root cause, not srun's echo


def test_with_max_restarts_a_job_whose_rank_was_killed_requeues_itself_and_resumes(launch, slurm_cluster):
    """Rank 1 (the second node) is killed outright in epoch 3: rank 0 sees it vanish, asks SLURM to
    requeue the job (max_restarts=1), and the job's next run resumes both nodes after epoch 2."""
    spe = 1438 // 64
    result = launch(*DDP_CPU[:3], "nprocs=1", *DDP_CPU[4:], "backend.nodes=2", "epochs=4", "max_restarts=1",
                    "fault.rank=1", "fault.kind=kill", f"fault.step={2 * spe + 3}",
                    env=clean_env(SLURM_CONF=slurm_cluster), timeout=300)
    assert result.returncode == 0, result.output
    run_dir = result.run_dir()
    assert _epochs(run_dir) == [1, 2, 3, 4]  # epochs 1-2 not trained again
    r = result.results()
    assert r["restarts"] == 1 and r["resumed_from"].endswith("checkpoints/last.pt") and r["ranks_agree"]
    assert r["hosts"] == ["lnode1", "lnode2"]
    job_id = json.loads((run_dir / "slurm.json").read_text())["job_id"]
    said = (run_dir / "slurm" / job_id / f"{job_id}_0_log.err").read_text()
    assert f"rank 0 failed; SLURM job {job_id} requeued: restart 1 of max_restarts=1" in said
    assert _job_field(slurm_cluster, job_id, "Restarts") == "1"


def test_without_waiting_the_job_id_and_paths_come_back_at_once(launch, slurm_cluster):
    result = launch("recipe=digits", "gpus=[]", "epochs=1", "backend=slurm", env=clean_env(SLURM_CONF=slurm_cluster))
    assert result.returncode == 0, result.output
    job_id = json.loads((result.run_dir() / "slurm.json").read_text())["job_id"]
    assert f"submitted SLURM job {job_id}" in result.stdout and "run dir" in result.stdout
    subprocess.run(["scancel", job_id], env=clean_env(SLURM_CONF=slurm_cluster), check=False)


def _wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def _epochs(run_dir: Path) -> list[int]:
    metrics = run_dir / "metrics.jsonl"
    if not metrics.exists():
        return []
    return [json.loads(line)["epoch"] for line in metrics.read_text().splitlines() if line.strip()]


LONG_RUN_EPOCHS = 10  # long enough to be interrupted after epoch 3, short enough for CI


def _interrupted_long_run(launch, slurm_cluster: str, interrupt: list[str],
                          nodes: int = 1) -> tuple[Path, str, dict]:
    """Submit a LONG_RUN_EPOCHS-epoch 2-rank job (2 tasks on one node, or 1 on each of 2), run `interrupt + [job id]`
    after its 3rd epoch, wait for it to end. Returns the run dir, the job id and results.json."""
    env = clean_env(SLURM_CONF=slurm_cluster)
    submitted = launch("recipe=digits", "gpus=[]", "strategy=ddp", f"nprocs={2 // nodes}", f"backend.nodes={nodes}",
                       f"epochs={LONG_RUN_EPOCHS}", "backend=slurm", env=env)
    assert submitted.returncode == 0, submitted.output
    run_dir = submitted.run_dir()
    job_id = json.loads((run_dir / "slurm.json").read_text())["job_id"]
    # (a wait, not a speed claim: under the suite's load a two-node job's start alone has taken a minute)
    _wait_for(lambda: len(_epochs(run_dir)) >= 3, 300, "3 epochs before the interruption")
    subprocess.run([*interrupt, job_id], env=env, check=True)
    _wait_for(lambda: (run_dir / "results.json").exists(), 400, "the requeued job to finish")
    return run_dir, job_id, json.loads((run_dir / "results.json").read_text())


def test_a_preempted_job_resumes_and_trains_each_epoch_once(launch, slurm_cluster):
    """SIGUSR2 (what SLURM sends before a preemption or the time limit) mid-run: the ranks finish the
    epoch, rank 0 checkpoints and requeues; the requeued job continues the same run dir."""
    run_dir, job_id, results = _interrupted_long_run(launch, slurm_cluster, ["scancel", "--signal=USR2"], nodes=2)
    assert _epochs(run_dir) == list(range(1, LONG_RUN_EPOCHS + 1))  # every epoch once, none lost or repeated
    assert results["hosts"] == ["lnode1", "lnode2"]  # a job over both nodes
    assert results["resumed_from"].endswith("checkpoints/last.pt") and results["ranks_agree"]
    assert results["test_acc"] >= 0.95
    log = (run_dir / "train.log").read_text()
    assert "SIGUSR2" in log and "requeued" in log
    assert _job_field(slurm_cluster, job_id, "Restarts") == "1"


def test_a_finished_job_that_is_requeued_does_not_train_again(launch, slurm_cluster):
    env = clean_env(SLURM_CONF=slurm_cluster)
    done = launch("recipe=digits", "gpus=[]", "epochs=2", "backend=slurm", "backend.wait=true", env=env)
    assert done.returncode == 0, done.output
    run_dir = done.run_dir()
    job_id = json.loads((run_dir / "slurm.json").read_text())["job_id"]
    before = (run_dir / "results.json").read_text()
    subprocess.run(["scontrol", "requeue", job_id], env=env, check=True)
    stdout = run_dir / "slurm" / job_id / f"{job_id}_0_log.out"
    _wait_for(lambda: "not running it again" in stdout.read_text(), 120, "the requeued run to stop at once")
    assert (run_dir / "results.json").read_text() == before and _epochs(run_dir) == [1, 2]


def test_a_three_point_sweep_is_one_job_array_with_a_summary(launch, slurm_cluster):
    # (the test cluster places a job on the least loaded node: two run at once, one on each node)
    result = launch("-m", "recipe=digits", "gpus=[]", "epochs=1", "batch_size=32,64,128", "backend=slurm",
                    "backend.wait=true", "backend.array_parallelism=2", env=clean_env(SLURM_CONF=slurm_cluster),
                    timeout=300)
    assert result.returncode == 0, result.output
    assert "submitted SLURM job array" in result.stdout and "at most 2 at once" in result.stdout
    sweep_dir = next(result.cwd.glob("multirun/*/*/summary.csv")).parent
    job_ids = [json.loads((sweep_dir / str(n) / "slurm.json").read_text())["job_id"] for n in range(3)]
    array = job_ids[0].split("_")[0]
    assert job_ids == [f"{array}_{n}" for n in range(3)]  # one array, one element per run
    with open(sweep_dir / "summary.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 3 and all(r["exit_code"] == "0" and float(r["test_acc"]) > 0.3 for r in rows)
    hosts = {json.loads((sweep_dir / str(n) / "results.json").read_text())["hosts"][0] for n in range(3)}
    assert hosts == {"lnode1", "lnode2"}  # the array spread over both nodes
    assert (sweep_dir / "summary.png").read_bytes()[:4] == b"\x89PNG"
    summary = (sweep_dir / "summary.md").read_text()
    assert summary.count("\n") == 7  # header, rule, 3 rows, and the best run after a blank line
    best = max(rows, key=lambda r: float(r["test_acc"]))
    assert f"\nbest: job {best['job']} (" in summary and summary.rstrip().endswith(f": {best['run_dir']}")


def test_a_sweep_under_hydras_own_submitit_slurm_launcher_trains_every_run(launch, slurm_cluster):
    """hydra-submitit-launcher submits each run itself; launch's task function then trains it inside the job."""
    result = launch("-m", "hydra/launcher=submitit_slurm", "recipe=digits", "gpus=[]", "epochs=1",
                    "batch_size=32,64", env=clean_env(SLURM_CONF=slurm_cluster), timeout=300)
    assert result.returncode == 0, result.output
    runs = [json.loads(p.read_text()) for p in sorted(result.cwd.glob("multirun/*/*/*/results.json"))]
    assert sorted(r["batch_size"] for r in runs) == [32, 64] and all(r["test_acc"] > 0.3 for r in runs)
    # (the jobs print into their logs: the console said nothing until this table)
    assert "launch: under hydra/launcher=submitit_slurm, 2 runs in multirun/" in result.stdout, result.output
    assert ": 2 finished\n" in result.stdout and "batch_size=64" in result.stdout, result.output
