"""`backend=slurm`: the same launch, submitted as a SLURM job through submitit.

What is requested follows from the same choices as a local run (launcher/strategy.py):
    ddp    one task per GPU (`gpus=4` -> 4 tasks and 4 GPUs per node), or per CPU rank (`nprocs`)
    dp     one task holding all the node's GPUs;   single: one task, one GPU
and `backend.nodes` multiplies the world. Each task runs `launch` again inside the allocation with
`backend=local`: with several tasks every one joins the srun world as one rank (launcher/distenv.py
reads SLURM's variables through submitit), with one task it spawns its worker as on a workstation.
GPU ids inside a task are relative to the mask SLURM gave it. The run dir is the one this launch
made: the job writes its results, checkpoints and train.log there, and submitit's files sit in
`slurm/` inside it.

sbatch options come from `backend.*`; submitit writes them into the batch script quoted
(`shlex.quote`), and config.validate refuses control characters, so no value can add a line to the
script. `dry_run=true` prints that script instead of submitting it.
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from launcher.config import ConfigError
from launcher.spawn import Outcome
from launcher.strategy import Layout, choose

SUBMITIT_DIR = "slurm"
# Overrides the tasks must not inherit: the tasks run locally inside the allocation, on what it holds.
_TASK_DROPS = ("backend", "gpus=", "nprocs=", "dry_run=", "hydra.run.dir=", "hydra.sweep.")


def requested_gpus(cfg: DictConfig) -> int:
    """GPUs per node: a count, or the length of a list (ids mean nothing before the job has its nodes)."""
    gpus = cfg.gpus
    if isinstance(gpus, bool):
        gpus = None
    if isinstance(gpus, int) and gpus >= 0:
        return gpus
    if gpus is not None and not isinstance(gpus, (str, int)):
        return len(list(gpus))
    raise ConfigError("gpus", gpus, "with backend=slurm say how many GPUs per node (the node is not known "
                      "yet), or [] for CPU", "gpus=4 backend=slurm")


def job_layout(cfg: DictConfig) -> tuple[Layout, int]:
    """(the layout of one node, tasks per node)."""
    gpus = requested_gpus(cfg)
    nodes = cfg.backend.nodes
    per_node = choose(cfg.strategy.name, gpus, cfg.nprocs, cfg.batch_size, cfg.strategy.backend, str(gpus))
    tasks = per_node.nprocs if per_node.strategy == "ddp" else 1
    if nodes > 1:
        if per_node.strategy != "ddp":
            raise ConfigError("backend.nodes", nodes, f"strategy={per_node.strategy} runs one process; several "
                              "nodes need ddp", "strategy=ddp backend.nodes=2")
        choose("ddp", gpus * nodes if gpus else 0, None if gpus else tasks * nodes, cfg.batch_size,
               cfg.strategy.backend, str(gpus))  # the global batch must split over every rank
    return per_node, tasks


def sbatch_parameters(cfg: DictConfig) -> dict[str, Any]:
    """submitit's SlurmExecutor parameters for this run (submitit adds the log paths)."""
    b = cfg.backend
    layout, tasks = job_layout(cfg)
    params: dict[str, Any] = {
        "job_name": b.job_name or f"launch-{cfg.recipe.name}",
        "time": b.time_min,
        "nodes": b.nodes,
        "ntasks_per_node": tasks,
        "stderr_to_stdout": False,
    }
    if layout.num_devices:
        params["gpus_per_node"] = layout.num_devices
    optional = {"partition": b.partition, "account": b.account, "qos": b.qos, "constraint": b.constraint,
                "exclude": b.exclude, "cpus_per_task": b.cpus_per_task,
                "mem": f"{b.mem_gb}GB" if b.mem_gb else None}
    params.update({k: v for k, v in optional.items() if v is not None})
    if b.additional:
        params["additional_parameters"] = {str(k): str(v) for k, v in b.additional.items()}
    return params


def task_overrides(user_overrides: list[str], cfg: DictConfig, run_dir: Path) -> list[str]:
    """The command line each task runs: the user's overrides, run locally on what the task was given."""
    kept = [o for o in user_overrides if not o.lstrip("+~").startswith(_TASK_DROPS)]
    on_gpu = requested_gpus(cfg) > 0
    return [*kept, "backend=local", f"gpus={'all' if on_gpu else '[]'}", "nprocs=null",
            f"hydra.run.dir={run_dir}"]


class TaskCommand:
    """What submitit runs in every task: `launch` with the given overrides, in this process.

    After a requeue (launcher/preemption.py) the same command runs again: it continues the run dir
    from its checkpoint, or does nothing when the run had finished. A task whose training processes
    requeued the job leaves without a result, so submitit keeps waiting for the requeued run.
    """

    def __init__(self, overrides: list[str], run_dir: str, max_requeues: int = 3):
        self.overrides = overrides
        self.run_dir = run_dir
        self.max_requeues = max_requeues

    def __call__(self) -> int:
        import os
        import signal

        from launcher import preemption
        from launcher.cli import main

        if preemption.restart_count() > 0 and (Path(self.run_dir) / "results.json").exists():
            print("launch: this run had finished before the job was requeued; not running it again", flush=True)
            return 0
        os.environ[preemption.ENABLE_ENV] = "1"
        os.environ[preemption.MAX_ENV] = str(self.max_requeues)
        # The training processes act on SIGUSR2 at the end of their epoch (they set their own handler);
        # this one, and submitit's handler in it, must not requeue and exit in the middle of one.
        signal.signal(signal.SIGUSR2, signal.SIG_IGN)
        try:
            main(self.overrides)
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
            if preemption.was_preempted(Path(self.run_dir)):
                os._exit(preemption.PREEMPTED_EXIT)
            if code:
                raise RuntimeError(f"launch exited with code {code}; see {self.run_dir}/train.log") from None
        return 0

    def __repr__(self) -> str:  # shown by submitit in its logs
        return "launch " + " ".join(shlex.quote(o) for o in self.overrides)


def sbatch_script(cfg: DictConfig, run_dir: Path) -> str:
    """The batch script submitit would submit, for `dry_run=true` (no SLURM needed to print it)."""
    from submitit.slurm.slurm import _make_sbatch_string

    folder = run_dir / SUBMITIT_DIR / "%j"
    command = " ".join([shlex.quote(sys.executable), "-u -m submitit.core._submit", shlex.quote(str(folder))])
    return _make_sbatch_string(command=command, folder=folder, **sbatch_parameters(cfg))


def submit(cfg: DictConfig, run_dir: Path, user_overrides: list[str]) -> Outcome:
    """Submit the run; with backend.wait=true follow it to the end. Prints where everything goes."""
    params = sbatch_parameters(cfg)
    executor = _executor(run_dir)
    if isinstance(executor, str):
        return Outcome(2, error=executor)
    executor.update_parameters(**params)
    command = TaskCommand(task_overrides(user_overrides, cfg, run_dir), str(run_dir), cfg.backend.max_requeues)
    try:
        job = executor.submit(command)
    except Exception as exc:  # noqa: BLE001 - sbatch's refusal (bad partition, account...) in its words
        return Outcome(2, error=f"sbatch refused the job: {_last_line(exc)}")
    (run_dir / "slurm.json").write_text(json.dumps({
        "job_id": job.job_id, "sbatch": params, "task_command": repr(command),
        "stdout": str(job.paths.stdout), "stderr": str(job.paths.stderr)}, indent=2) + "\n")
    tasks = params["nodes"] * params["ntasks_per_node"]
    print(f"launch: submitted SLURM job {job.job_id} ({tasks} task{'s' if tasks > 1 else ''} on "
          f"{params['nodes']} node{'s' if params['nodes'] > 1 else ''})\n"
          f"  run dir  {run_dir}\n  log      {run_dir / 'train.log'} (once it runs)\n"
          f"  slurm    {job.paths.stdout} / {job.paths.stderr}", flush=True)
    if not cfg.backend.wait:
        return Outcome(0)
    try:
        job.results()  # one per task; waits for the job and re-raises a task's error
    except Exception as exc:  # noqa: BLE001 - the job failed: submitit re-raises the task's error
        return Outcome(1, error=f"SLURM job {job.job_id} ended {job.state}: {_why(run_dir, exc)}")
    results = run_dir / "results.json"
    where = f"results: {results}" if results.exists() else f"run dir: {run_dir}"
    print(f"launch: SLURM job {job.job_id} finished; {where}", flush=True)
    return Outcome(0)


def _executor(folder: Path):
    """submitit's SlurmExecutor writing into `folder`/slurm, or the one-line reason there is none."""
    import submitit

    try:
        return submitit.SlurmExecutor(folder=folder / SUBMITIT_DIR / "%j")
    except RuntimeError as exc:  # no srun on this machine
        return (f"backend=slurm needs SLURM's commands on this machine ({exc}); print the batch script "
                "with dry_run=true")


def _why(run_dir: Path, exc: BaseException) -> str:
    """The failing rank's own exception when a worker recorded one (failures/), else what submitit saw."""
    from launcher.failures import read_records, root_cause

    cause = root_cause(read_records(run_dir))
    if cause is None:
        return _last_line(exc)
    return f"rank {cause.rank} failed: {cause.exc_type}: {cause.message} (traceback: {run_dir / 'failures'})"


def _last_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    return lines[-1] if lines else type(exc).__name__


def submit_sweep(entries: list[tuple[int, DictConfig, Path, list[str]]], sweep_dir: Path) -> int:
    """A `launch -m ... backend=slurm` sweep as SLURM job arrays (one per distinct resource request), at
    most `backend.array_parallelism` jobs running at once. With backend.wait=true it follows them and
    writes the sweep summary (launcher/sweep.py). Returns the exit code."""
    from launcher.sweep import SweepJob, report

    # Runs that ask for different resources (a swept gpus or backend.*) go in arrays of their own.
    groups: dict[str, tuple[dict[str, Any], list[tuple[int, DictConfig, Path, list[str]]]]] = {}
    for entry in entries:
        params = sbatch_parameters(entry[1])
        groups.setdefault(json.dumps(params, sort_keys=True), (params, []))[1].append(entry)
    submitted: list[tuple[SweepJob, Any]] = []
    for params, members in groups.values():
        cfg = members[0][1]
        executor = _executor(sweep_dir)
        if isinstance(executor, str):
            print(f"launch: {executor}", file=sys.stderr)
            return 2
        executor.update_parameters(**params, array_parallelism=cfg.backend.array_parallelism)
        commands = []
        for _num, job_cfg, run_dir, overrides in members:
            run_dir.mkdir(parents=True, exist_ok=True)
            commands.append(TaskCommand(task_overrides(overrides, job_cfg, run_dir), str(run_dir),
                                        job_cfg.backend.max_requeues))
        try:
            with executor.batch():
                jobs = [executor.submit(c) for c in commands]
        except Exception as exc:  # noqa: BLE001 - sbatch's refusal in its words
            print(f"launch: sbatch refused the sweep: {_last_line(exc)}", file=sys.stderr)
            return 2
        array_id = jobs[0].job_id.split("_")[0]
        print(f"launch: submitted SLURM job array {array_id} ({len(jobs)} runs, at most "
              f"{min(len(jobs), cfg.backend.array_parallelism)} at once); sweep dir {sweep_dir}", flush=True)
        for (num, _, run_dir, overrides), job in zip(members, jobs, strict=True):
            (run_dir / "slurm.json").write_text(json.dumps({"job_id": job.job_id, "sbatch": params}, indent=2) + "\n")
            print(f"  job {num}: {job.job_id}  {' '.join(overrides)}", flush=True)
            submitted.append((SweepJob(num, overrides, run_dir), job))
    if not all(cfg.backend.wait for _, cfg, _, _ in entries):
        print("launch: not waiting (backend.wait=false); the summary is written by a sweep run with "
              "backend.wait=true", flush=True)
        return 0
    worst = 0
    for sweep_job, job in submitted:
        try:
            job.results()
            sweep_job.exit_code = 0
        except Exception as exc:  # noqa: BLE001 - one failed run does not stop the others
            sweep_job.exit_code = 1
            worst = 1
            print(f"sweep: job {sweep_job.num} ({job.job_id}) FAILED: {_why(sweep_job.run_dir, exc)}",
                  file=sys.stderr, flush=True)
    report([j for j, _ in submitted], sweep_dir)
    return worst

