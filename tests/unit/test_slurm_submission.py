"""backend=slurm before anything is submitted: what is requested, what each task runs, the batch script."""

import pickle
import sys
from pathlib import Path

import pytest
from omegaconf import open_dict

from launcher.config import LocalBackendConfig
from launcher.errors import ConfigError
from launcher.host.backends import slurm
from launcher.host.compose import typed
from tests.conftest import composed, config_of

GOLDEN = Path(__file__).parent / "golden"


def slurm_config(*overrides: str):
    return config_of("backend=slurm", *overrides)


def test_ddp_on_gpus_is_one_task_per_gpu():
    params = slurm.sbatch_parameters(slurm_config("recipe=cifar10", "gpus=4", "batch_size=1024"))
    assert params["ntasks_per_node"] == 4 and params["gpus_per_node"] == 4 and params["nodes"] == 1


def test_dataparallel_is_one_task_with_all_the_gpus():
    params = slurm.sbatch_parameters(slurm_config("recipe=cifar10", "gpus=2", "strategy=dp"))
    assert params["ntasks_per_node"] == 1 and params["gpus_per_node"] == 2


def test_cpu_ranks_are_tasks_and_no_gpu_is_asked_for():
    params = slurm.sbatch_parameters(slurm_config("gpus=[]", "strategy=ddp", "nprocs=2"))
    assert params["ntasks_per_node"] == 2 and "gpus_per_node" not in params


def test_gpus_must_be_a_count_before_the_nodes_are_known():
    with pytest.raises(ConfigError, match="gpus=4 backend=slurm"):
        slurm.sbatch_parameters(slurm_config("gpus=auto"))


def test_several_nodes_need_ddp_and_a_batch_that_splits_over_every_rank():
    with pytest.raises(ConfigError, match="backend.nodes"):
        slurm.sbatch_parameters(slurm_config("recipe=cifar10", "gpus=2", "strategy=dp", "backend.nodes=2"))
    with pytest.raises(ConfigError, match="split evenly over 6 ranks"):
        slurm.sbatch_parameters(slurm_config("gpus=3", "batch_size=64", "backend.nodes=2"))


def test_tasks_run_locally_on_what_the_allocation_gave_them():
    cfg = slurm_config("recipe=cifar10", "gpus=4", "backend.partition=gpu", "epochs=3")
    task = slurm.task_config(cfg)
    assert isinstance(task.backend, LocalBackendConfig) and task.gpus == "all" and task.nprocs is None
    assert task.epochs == 3 and task.recipe == cfg.recipe
    cpu = slurm.task_config(slurm_config("gpus=[]", "strategy=ddp", "nprocs=2"))
    assert cpu.gpus == [] and cpu.nprocs is None


def test_the_task_command_carries_the_checked_config_itself():
    command = slurm.TaskCommand(slurm.task_config(slurm_config("gpus=[]", "epochs=3")), "/runs/a", max_requeues=2)
    again = pickle.loads(pickle.dumps(command))  # submitit pickles it for the job
    assert again.cfg.epochs == 3 and again.run_dir == "/runs/a" and again.max_requeues == 2


@pytest.mark.parametrize("override", ["backend.partition='gpu\n#SBATCH --uid=0'", "backend.account='a\rb'",
                                      "+backend.additional.comment='x\ny'"])
def test_a_value_that_would_add_a_line_to_the_script_is_refused(override):
    with pytest.raises(ConfigError, match="control characters"):
        slurm_config(override)


def test_an_option_name_that_is_not_one_is_refused():
    cfg = composed("backend=slurm")
    with open_dict(cfg):
        cfg.backend.additional["x y"] = 1  # (not even typeable as an override)
    with pytest.raises(ConfigError, match="option names"):
        typed(cfg).check()


def test_the_batch_script_matches_the_golden_file(monkeypatch):
    """Spaces and quotes stay inside one quoted #SBATCH value (sbatch accepted this job name on the
    test cluster, see tests/slurm)."""
    monkeypatch.setattr(sys, "executable", "/venv/bin/python")
    cfg = slurm_config("gpus=[]", "strategy=ddp", "nprocs=2", "backend.partition=debug", "backend.time_min=30",
                       "backend.job_name='my run'", "backend.mem_gb=8",
                       """+backend.additional.comment='it\\'s "ours"'""")
    script = slurm.sbatch_script(cfg, Path("/runs/2026-11-22/digits"))
    assert script == (GOLDEN / "sbatch_ddp_cpu.txt").read_text()


def test_a_rank_that_left_no_record_is_named_over_the_peer_that_saw_it_vanish(tmp_path):
    """A rank killed outright (or lost with its node) writes no failure record; its peers' records only
    say the connection dropped. The job's failure names the silent rank, not its echo."""
    from launcher import failures

    echo = RuntimeError("[../gloo/transport/tcp/pair.cc:537] Read error [198.18.1.12]:9898: Connection reset by peer")
    failures.write_record(tmp_path, 0, 0, echo, 1)
    failures.write_record(tmp_path, 2, 0, echo, 1)
    why = slurm._why(tmp_path, RuntimeError("srun: error"), "77", world_size=4)
    assert why.startswith("ranks 1, 3 died without a Python traceback"), why
    assert "Connection reset by peer" in why and str(tmp_path / "slurm" / "77" / "77_1_log.err") in why
    failures.write_record(tmp_path, 1, 0, ValueError("bad shape"), 1)  # a rank that did say why wins
    assert slurm._why(tmp_path, RuntimeError("srun"), "77", world_size=4).startswith("rank 1 failed: ValueError")


def test_a_requeued_jobs_tasks_count_its_requeues_as_restart_attempts():
    from launcher.world import WorldInfo

    assert WorldInfo.from_env({"RANK": "1", "WORLD_SIZE": "2", "SLURM_RESTART_COUNT": "2"}).restart_count == 2
    both = {"TORCHELASTIC_RESTART_COUNT": "1", "SLURM_RESTART_COUNT": "3"}
    assert WorldInfo.from_env(both).restart_count == 1  # elastic's own restarts, where elastic runs the workers


class _Job:
    """submitit's job handle, as far as SlurmBackend.run reads it: the job ends with `error` (or well)."""

    def __init__(self, error=None):
        self.job_id, self.state, self.error = "77", "FAILED" if error else "COMPLETED", error
        self.paths = type("Paths", (), {"stdout": "/x/77.out", "stderr": "/x/77.err"})()

    def results(self):
        if self.error:
            raise self.error
        return [0]


class _Executor:
    def __init__(self, job):
        self.job, self.parameters = job, {}

    def update_parameters(self, **params):
        self.parameters.update(params)

    def submit(self, command):
        return self.job


def test_backend_wait_follows_the_job_and_its_failure_is_the_launchs(tmp_path, monkeypatch):
    """backend.wait=true: launch waits for the job and exits as it ended, naming the ranks that died without a
    word on every node (a 2-node job of 2 tasks each: ranks 2-3 are the second node's)."""
    from launcher import failures
    from launcher.host.launch import launch
    from launcher.host.outcome import LaunchContext

    echo = RuntimeError("[../gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer")
    failures.write_record(tmp_path, 0, 0, echo, 1)
    failures.write_record(tmp_path, 1, 0, echo, 1)
    monkeypatch.setattr(slurm, "_executor", lambda folder: _Executor(_Job(RuntimeError("srun: error: task 2"))))
    cfg = slurm_config("gpus=[]", "strategy=ddp", "nprocs=2", "backend.nodes=2", "backend.wait=true")
    outcome = launch(cfg, tmp_path, LaunchContext(started=0.0))
    assert outcome.exit_code == 1 and outcome.error.startswith("SLURM job 77 ended FAILED: ranks 2-3 died"), outcome
    monkeypatch.setattr(slurm, "_executor", lambda folder: _Executor(_Job(RuntimeError("srun: error"))))
    assert launch(slurm_config("gpus=[]", "backend.wait=false"), tmp_path / "b",
                  LaunchContext(started=0.0)).exit_code == 0  # (not followed: submitted is all it says)


class _Interrupted(_Job):
    """A job followed when Ctrl-C lands: still running, cancellable."""

    def __init__(self):
        super().__init__()
        self.state, self.cancelled = "RUNNING", False

    def results(self):
        raise KeyboardInterrupt

    def done(self):
        return False

    def cancel(self, check=True):
        self.cancelled = True


def test_ctrl_c_while_following_a_job_cancels_it_and_a_job_that_refused_its_input_exits_2(tmp_path, monkeypatch,
                                                                                          capsys):
    """backend.wait=true and Ctrl-C: launch said "every run it started was stopped" while the job trained on to
    its end (a new user's trial): it is cancelled, and said so. A job whose launch refused its input (a corrupt
    image: exit 2 in its outcome.json) exits 2 as a local run does, not 1, and not "ended RUNNING"."""
    import json

    import pytest

    from launcher.host.launch import launch
    from launcher.host.outcome import LaunchContext

    job = _Interrupted()
    monkeypatch.setattr(slurm, "_executor", lambda folder: _Executor(job))
    with pytest.raises(KeyboardInterrupt):
        launch(slurm_config("gpus=[]", "backend.wait=true"), tmp_path / "a", LaunchContext(started=0.0))
    assert job.cancelled and "launch: Ctrl-C: cancelled SLURM job 77 (scancel)" in capsys.readouterr().err
    refused = _Job(RuntimeError("launch exited with code 2"))
    refused.state = "RUNNING"
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "outcome.json").write_text(json.dumps({"exit_code": 2, "error": "a corrupt image"}))
    monkeypatch.setattr(slurm, "_executor", lambda folder: _Executor(refused))
    outcome = launch(slurm_config("gpus=[]", "backend.wait=true"), tmp_path / "b", LaunchContext(started=0.0))
    assert outcome.exit_code == 2 and outcome.error.startswith("SLURM job 77 failed: "), outcome


def test_only_the_job_run_that_asked_for_its_requeue_leaves_as_preempted(tmp_path):
    """A job requeued once (marker 0) that fails for real in its next run (restart 1) fails; it is not requeued."""
    (tmp_path / "preempted").write_text("0")
    assert slurm.was_preempted(tmp_path, 0)
    assert not slurm.was_preempted(tmp_path, 1)
