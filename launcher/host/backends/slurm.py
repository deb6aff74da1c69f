"""backend=slurm: the same launch, submitted as a SLURM job through submitit.

What is requested follows from the same strategy choice as a local run (launcher/strategies):
    ddp    one task per GPU (`gpus=4` -> 4 tasks and 4 GPUs per node), or per CPU rank (`nprocs`)
    dp     one task holding all the node's GPUs;   single: one task, one GPU
and `backend.nodes` multiplies the world. Each task runs the launch again inside the allocation, on
this host's side (launcher/host/run_here.py) with backend=local and the GPUs the task was given: with
several tasks every one joins the srun world as one rank (launcher/world.py reads SLURM's variables
through submitit), with one task it spawns its worker as on a workstation. The task gets the checked,
typed config itself (pickled by submitit), not a command line to compose again. The run dir is the
one this launch made: the job writes its results, checkpoints and train.log there, and submitit's
files sit in `slurm/` inside it.

sbatch options come from `backend.*`; submitit writes them into the batch script quoted
(`shlex.quote`), and SlurmBackendConfig.check refuses control characters, so no value can add a line
to the script. `dry_run=true` prints that script instead of submitting it.

A sweep (`launch -m ... backend=slurm`) is one job array per distinct resource request, at most
`backend.array_parallelism` runs at once; with backend.wait=true launch follows it and writes the
sweep's summary.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from launcher import strategies
from launcher.bytecode import enable as keep_bytecode
from launcher.config import Config, LocalBackendConfig, SlurmBackendConfig, derive
from launcher.errors import LaunchError
from launcher.files import CONFIG, LOG, OUTCOME, PREEMPTED, RESULTS, SLURM_RECORD, read_json
from launcher.host import trackers
from launcher.host.backends.base import Backend
from launcher.host.compose import allow_imports_from_cwd, to_yaml
from launcher.host.gpus import GpuRequest
from launcher.host.outcome import LaunchContext, Outcome
from launcher.host.run_here import check_runnable, run_here
from launcher.host.spawn import prestart_worker_interpreter
from launcher.host.sweep import SweepContext, SweepJob, save_hydra_files
from launcher.spec import PREEMPTED_EXIT, RequeuePolicy
from launcher.strategies import Devices, Strategy
from launcher.world import existing_world

SUBMITIT_DIR = "slurm"


def job_strategy(cfg: Config) -> Strategy:
    """The strategy of one node of the job; its processes are the node's tasks."""
    request = GpuRequest.parse(cfg.gpus)
    per_node = request.per_node()  # ids mean nothing before the job has its nodes: a count
    return strategies.choose(cfg.strategy, Devices(tuple(range(per_node))), nprocs=cfg.nprocs,
                             global_batch=cfg.batch_size, perf=cfg.perf, gpus_text=request.text,
                             nodes=cfg.backend.nodes, accumulate=cfg.accumulate,
                             nodes_key="backend.nodes").strategy


def run_label(cfg: Config) -> str:
    return Path(cfg.script).stem if cfg.script else cfg.recipe.name


def sbatch_parameters(cfg: Config) -> dict[str, Any]:
    """submitit's SlurmExecutor parameters for this run (submitit adds the log paths)."""
    b: SlurmBackendConfig = cfg.backend
    strategy = job_strategy(cfg)
    params: dict[str, Any] = {
        "job_name": b.job_name or f"launch-{run_label(cfg)}",
        "time": b.time_min,
        "nodes": b.nodes,
        "ntasks_per_node": strategy.processes,
        "stderr_to_stdout": False,
    }
    if strategy.devices.on_gpu:
        params["gpus_per_node"] = strategy.devices.count
    optional = {"partition": b.partition, "account": b.account, "qos": b.qos, "constraint": b.constraint,
                "exclude": b.exclude, "cpus_per_task": b.cpus_per_task,
                "mem": f"{b.mem_gb}GB" if b.mem_gb else None}
    params.update({k: v for k, v in optional.items() if v is not None})
    if b.additional:
        params["additional_parameters"] = {str(k): str(v) for k, v in b.additional.items()}
    return params


def task_config(cfg: Config) -> Config:
    """What each task runs: this config, locally, on what the allocation gave the task."""
    on_gpu = GpuRequest.parse(cfg.gpus).per_node() > 0
    return derive(cfg, backend=LocalBackendConfig(), gpus="all" if on_gpu else [], nprocs=None)


def restart_count() -> int:
    """How many times SLURM has requeued this job (0 for its first run)."""
    try:
        return int(os.environ.get("SLURM_RESTART_COUNT", "0"))
    except ValueError:
        return 0


def was_preempted(run_dir: Path, restart: int) -> bool:
    """True in the job run that asked for its own requeue (the marker names that run)."""
    marker = Path(run_dir) / PREEMPTED
    return marker.exists() and marker.read_text().strip() == str(restart)


class TaskCommand:
    """What submitit runs in every task: the launch, in this process, on what the task was given.

    After a requeue (launcher/train/preemption.py) the same command runs again: it continues the run
    dir from its checkpoint, or does nothing when the run had finished. A task whose training
    processes requeued the job leaves without a result, so submitit keeps waiting for the requeued run.
    """

    def __init__(self, cfg: Config, run_dir: str, max_requeues: int = 3):
        self.cfg = cfg
        self.run_dir = run_dir
        self.max_requeues = max_requeues

    def __call__(self) -> int:
        run_dir = Path(self.run_dir)
        restart = restart_count()
        if restart > 0 and (run_dir / RESULTS).exists():
            print("launch: this run had finished before the job was requeued; not running it again", flush=True)
            return 0
        keep_bytecode()
        allow_imports_from_cwd()
        if existing_world() is None:  # one task: it spawns its workers
            prestart_worker_interpreter()
        # The training processes act on SIGUSR2 at the end of their epoch (they set their own handler);
        # this one, and submitit's handler in it, must not requeue and exit in the middle of one.
        signal.signal(signal.SIGUSR2, signal.SIG_IGN)
        policy = RequeuePolicy(os.environ.get("SLURM_JOB_ID", ""), restart, self.max_requeues)
        outcome = run_here(self.cfg, run_dir, LaunchContext(started=time.time(), requeue=policy))
        if outcome.error:
            print(f"launch: {outcome.error}", file=sys.stderr, flush=True)
        if outcome.exit_code:
            if was_preempted(run_dir, restart):
                os._exit(PREEMPTED_EXIT)
            raise RuntimeError(f"launch exited with code {outcome.exit_code}; see {run_dir / LOG}")
        return 0

    def __repr__(self) -> str:  # shown by submitit in its logs
        return f"launch {run_label(self.cfg)} in {self.run_dir}"


def sbatch_script(cfg: Config, run_dir: Path) -> str:
    """The batch script submitit would submit, for `dry_run=true` (no SLURM needed to print it)."""
    from submitit.slurm.slurm import _make_sbatch_string

    folder = run_dir / SUBMITIT_DIR / "%j"
    command = " ".join([shlex.quote(sys.executable), "-u -m submitit.core._submit", shlex.quote(str(folder))])
    return _make_sbatch_string(command=command, folder=folder, **sbatch_parameters(cfg))


def _executor(folder: Path):
    """submitit's SlurmExecutor writing into `folder`/slurm, or the one-line reason there is none."""
    import submitit

    try:
        return submitit.SlurmExecutor(folder=folder / SUBMITIT_DIR / "%j")
    except RuntimeError as exc:  # no srun on this machine
        return (f"backend=slurm needs SLURM's commands on this machine ({exc}); print the batch script "
                "with dry_run=true")


def _why(run_dir: Path, exc: BaseException, job_id: str = "", world_size: int | None = None) -> str:
    """The failing rank's own exception when a worker recorded one (failures/); a rank that left no record
    while its peers only saw it vanish (killed, its node lost); else what submitit saw."""
    from launcher.failures import read_records, root_cause, short_headline, span

    records = read_records(run_dir)
    cause = root_cause(records)
    if cause is not None and cause.secondary and world_size:
        latest = [r for r in records if r.attempt == cause.attempt]
        silent = sorted(set(range(world_size)) - {r.rank for r in latest})
        if silent:
            ranks = f"rank{'s' if len(silent) > 1 else ''} {span(silent)}"
            logs = ", ".join(str(run_dir / SUBMITIT_DIR / job_id / f"{job_id}_{r}_log.err") for r in silent[:2])
            return (f"{ranks} died without a Python traceback (killed by a signal, the out-of-memory killer, or "
                    f"its node lost); rank {cause.rank} then saw: {short_headline(cause.headline)} (logs: {logs})")
    if cause is None:
        return _last_line(exc)
    return f"rank {cause.rank} failed: {cause.exc_type}: {cause.message} (traceback: {run_dir / 'failures'})"


@contextlib.contextmanager
def _cancelled_at_ctrl_c(handles: list[Any]) -> Iterator[None]:
    """A Ctrl-C while launch follows its jobs (backend.wait=true) cancels those not yet ended (scancel), as
    a local launch's Ctrl-C stops its runs: launch said "every run it started was stopped" while the jobs
    trained on to their end. Said in one line, job by job."""
    try:
        yield
    except KeyboardInterrupt:
        cancelled = []
        for handle in handles:
            with contextlib.suppress(Exception):
                if not handle.done():
                    handle.cancel(check=False)
                    cancelled.append(str(handle.job_id))
        if cancelled:
            print(f"launch: Ctrl-C: cancelled SLURM job{'s' if len(cancelled) > 1 else ''} {', '.join(cancelled)} "
                  "(scancel)", file=sys.stderr, flush=True)
        raise


def _ended(job: Any) -> str:
    """How a failed job ended, in words: its SLURM state where SLURM has one for it already (the error can
    come back before the state leaves RUNNING: "ended RUNNING" was said)."""
    state = str(getattr(job, "state", "") or "")
    return f"ended {state}" if state and state not in ("RUNNING", "PENDING", "REQUEUED", "UNKNOWN") else "failed"


def _job_exit_code(run_dir: Path) -> int:
    """The exit code the job's own launch recorded (outcome.json: 2 for input its workers refused, as a
    local launch exits), else 1."""
    code = read_json(run_dir / OUTCOME).get("exit_code")
    return code if isinstance(code, int) and code in (1, 2) else 1


def _last_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    return lines[-1] if lines else type(exc).__name__


class SlurmBackend(Backend):
    name = "slurm"
    options: SlurmBackendConfig

    def check(self, cfg: Config) -> None:
        check_runnable(cfg)
        trackers.check(cfg)  # (installed here; the job's own launch checks again where it runs)
        sbatch_parameters(cfg)  # tasks, GPUs and the batch split of the job

    def run(self, cfg: Config, run_dir: Path, context: LaunchContext) -> Outcome:
        """Submit the run; with backend.wait=true follow it to the end. Prints where everything goes."""
        self.check(cfg)  # a missing script or unknown model fails here, not in every task of the job
        params = sbatch_parameters(cfg)
        if cfg.dry_run:
            what = cfg.script if cfg.script else f"{cfg.recipe.name} ({cfg.recipe.model})"
            print(f"dry run: nothing submitted. The batch script for {what}:\n")
            print(sbatch_script(cfg, run_dir))
            return Outcome(0)
        executor = _executor(run_dir)
        if isinstance(executor, str):
            return Outcome(2, error=executor)
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / CONFIG).write_text(to_yaml(cfg))
        executor.update_parameters(**params)
        command = TaskCommand(task_config(cfg), str(run_dir), self.options.max_requeues)
        try:
            job = executor.submit(command)
        except Exception as exc:  # noqa: BLE001 - sbatch's refusal (bad partition, account...) in its words
            return Outcome(2, error=f"sbatch refused the job: {_last_line(exc)}")
        (run_dir / SLURM_RECORD).write_text(json.dumps({
            "job_id": job.job_id, "sbatch": params, "task_command": repr(command),
            "stdout": str(job.paths.stdout), "stderr": str(job.paths.stderr)}, indent=2) + "\n")
        tasks = params["nodes"] * params["ntasks_per_node"]
        print(f"launch: submitted SLURM job {job.job_id} ({tasks} task{'s' if tasks > 1 else ''} on "
              f"{params['nodes']} node{'s' if params['nodes'] > 1 else ''})\n"
              f"  run dir  {run_dir}\n  log      {run_dir / LOG} (once it runs)\n"
              f"  slurm    {job.paths.stdout} / {job.paths.stderr}", flush=True)
        if not self.options.wait:
            return Outcome(0)
        try:
            with _cancelled_at_ctrl_c([job]):
                job.results()  # one per task; waits for the job and re-raises a task's error
        except Exception as exc:  # noqa: BLE001 - the job failed: submitit re-raises the task's error
            why = _why(run_dir, exc, job.job_id, tasks)
            return Outcome(_job_exit_code(run_dir), error=f"SLURM job {job.job_id} {_ended(job)}: {why}")
        results = run_dir / RESULTS
        where = f"results: {results}" if results.exists() else f"run dir: {run_dir}"
        print(f"launch: SLURM job {job.job_id} finished; {where}", flush=True)
        return Outcome(0, results=json.loads(results.read_text()) if results.exists() else None)

    def sweep(self, jobs: list[SweepJob], context: SweepContext) -> None:
        """One job array per distinct resource request (a swept gpus or backend.* splits them)."""
        groups: dict[str, tuple[dict[str, Any], list[SweepJob]]] = {}
        for job in jobs:
            params = sbatch_parameters(job.cfg)
            groups.setdefault(json.dumps(params, sort_keys=True), (params, []))[1].append(job)
        submitted: list[tuple[SweepJob, Any]] = []
        for params, members in groups.values():
            options: SlurmBackendConfig = members[0].cfg.backend
            executor = _executor(context.sweep_dir)
            if isinstance(executor, str):
                raise LaunchError(executor)
            executor.update_parameters(**params, array_parallelism=options.array_parallelism)
            for job in members:
                job.run_dir.mkdir(parents=True, exist_ok=True)
                save_hydra_files(job)
            commands = [TaskCommand(task_config(job.cfg), str(job.run_dir), job.cfg.backend.max_requeues)
                        for job in members]
            try:
                with executor.batch():
                    handles = [executor.submit(c) for c in commands]
            except Exception as exc:  # noqa: BLE001 - sbatch's refusal in its words
                raise LaunchError(f"sbatch refused the sweep: {_last_line(exc)}") from None
            array_id = handles[0].job_id.split("_")[0]
            print(f"launch: submitted SLURM job array {array_id} ({len(handles)} runs, at most "
                  f"{min(len(handles), options.array_parallelism)} at once); sweep dir {context.sweep_dir}",
                  flush=True)
            for job, handle in zip(members, handles, strict=True):
                (job.run_dir / SLURM_RECORD).write_text(json.dumps({"job_id": handle.job_id, "sbatch": params},
                                                                   indent=2) + "\n")
                print(f"  job {job.num}: {handle.job_id}  {' '.join(job.overrides)}", flush=True)
                submitted.append((job, handle))
        followed = [(job, handle) for job, handle in submitted if job.cfg.backend.wait]
        with _cancelled_at_ctrl_c([handle for _, handle in followed]):
            for job, handle in followed:
                try:
                    handle.results()
                    job.finished(0)
                except Exception as exc:  # noqa: BLE001 - one failed run does not stop the others
                    tasks = (p := sbatch_parameters(job.cfg))["nodes"] * p["ntasks_per_node"]
                    why = _why(job.run_dir, exc, handle.job_id, tasks)
                    job.finished(_job_exit_code(job.run_dir), f"SLURM job {handle.job_id} {_ended(handle)}: {why}")
                    print(f"sweep: job {job.num} ({handle.job_id}) FAILED: {job.error}", file=sys.stderr,
                          flush=True)
