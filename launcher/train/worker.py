"""The function each worker process runs: apply the environment, set up logging, train, report failure.

It is the entry point of the training wing: the one handed to torch.distributed.elastic (spawned
workers) and the one called in place when `launch` joins a world that torchrun or srun started. All
it is given is a WorkerSpec (launcher/spec.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from pathlib import Path
from typing import Any

from launcher.errors import ExplainedStop, LaunchError
from launcher.lifetime import (
    answer_sigint,
    die_with_parent,
    finish_on_sigterm,
    name_this_process,
    never_lose_ctrl_c,
)
from launcher.spec import PREEMPTED_EXIT, WorkerSpec


def _let_forkserver_end_with_the_launcher() -> None:
    """A worker forked by the forkserver inherits a copy of the launcher's "still alive" pipe end, and
    the forkserver only exits once every copy is closed. Close ours: then a launcher killed outright
    takes the forkserver with it, and the forkserver's death reaches this worker as its parent-death
    signal (launcher/lifetime.py), so no worker outlives the launcher. Under `spawn` this is a no-op.
    """
    from multiprocessing import forkserver

    server = forkserver._forkserver
    fd = getattr(server, "_forkserver_alive_fd", None)
    if fd is not None:
        with contextlib.suppress(OSError):
            os.close(fd)
        server._forkserver_alive_fd = None


def _record_where_rank0_reads(world, exc: BaseException, code: int) -> None:
    """A node of a launch over several machines that shares rank 0's run dir: the record there too, so
    every node's launch can name the root cause (launcher/train/nodes.py)."""
    from launcher import failures
    from launcher.train import nodes

    dirs = nodes.met()
    if dirs is not None and dirs.shared and dirs.main != dirs.own:
        failures.write_record(dirs.main, world.rank, world.restart_count, exc, code)


def _requeue_after_failure(spec: WorkerSpec, run_dir: Path, rank: int) -> None:
    """backend=slurm with max_restarts=N: a failed job runs again, resuming from its last checkpoint, as
    a local launch's workers restart (at most N times). The first rank to fail in this run of the job
    asks SLURM (`scontrol requeue`, which ends the job's other tasks); a rank whose node died cannot,
    but its peers fail a moment later and one of them does."""
    import subprocess

    from launcher.files import FAILURES

    policy, allowed = spec.requeue, spec.config.max_restarts
    if policy is None or not policy.job_id or allowed <= 0:
        return
    folder = run_dir / FAILURES
    done = len(list(folder.glob("requeued-after-run*")))
    if done >= allowed:
        return
    try:
        os.close(os.open(folder / f"requeued-after-run{policy.restart_count}", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return  # another rank of this run asked already
    try:
        asked = subprocess.run(["scontrol", "requeue", policy.job_id], capture_output=True, text=True, timeout=60)
        said = "requeued" if asked.returncode == 0 else f"could not requeue ({asked.stderr.strip()[:200]})"
    except (OSError, subprocess.TimeoutExpired) as err:  # no scontrol on this node, or slurmctld silent
        said = f"could not requeue ({err})"
    print(f"launch: rank {rank} failed; SLURM job {policy.job_id} {said}: restart {done + 1} of max_restarts="
          f"{allowed}, from the last checkpoint", file=sys.stderr, flush=True)


def _as_a_fresh_process() -> None:
    """A worker forked from the launch process itself (LAUNCH_START_METHOD=fork) inherits the handlers elastic's
    agent installed there, which turn SIGTERM into an exception of the agent's: put Python's own back, as a
    forkserver's or a fresh interpreter's worker has them. It inherits the launch's heap too (Hydra's config,
    the plan, what the launch imported after its start): frozen here, as the forkserver freezes its imports
    before it forks (train/preload.py), so that no collection in the worker, heap.release's at the run's end
    included, walks the launch's objects, which hold no part of the run."""
    import gc
    import signal

    if os.environ.get("LAUNCH_START_METHOD") != "fork":
        return
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)
    gc.freeze()


def worker_main(spec: WorkerSpec) -> dict[str, Any] | None:
    # The mask and thread counts go in before anything can start CUDA in this process.
    os.environ.update(spec.env)
    _let_forkserver_end_with_the_launcher()
    _as_a_fresh_process()
    answer_sigint()  # (the agent forwards Ctrl-C as SIGINT: answered though launch started with it ignored)
    never_lose_ctrl_c()  # (Ctrl-C reaches every worker: one landing in a weakref callback ends it too)
    finish_on_sigterm()  # (stopped by elastic or SLURM: a checkpoint being written is finished first)
    die_with_parent()  # SIGKILL, not torch's SIGINT: a background job's workers ignore SIGINT
    # what ps and top show: a fork keeps its parent's name (a sweep's run is launch-job-N: its worker was too)
    name_this_process(f"launch-rank-{os.environ.get('RANK', '0')}")
    from launcher import failures, logs

    logs.survive_closed_console()
    from launcher.train.timeline import StartupTimeline
    from launcher.world import WorldInfo

    timeline = StartupTimeline(spec.started_at, {"spawn": spec.spawned_s} if spec.spawned_s is not None else None)
    timeline.mark("worker_process")
    world = WorldInfo.from_env()
    run_dir = Path(spec.run_dir)
    logs.setup_worker_logging(run_dir, world.rank)
    try:
        from launcher.train.loop import train

        return train(spec, world, timeline)
    except BaseException as exc:  # noqa: BLE001 - every failure is recorded, then the process ends
        if isinstance(exc, KeyboardInterrupt):  # Ctrl-C reached the whole group: the launcher says so
            os._exit(130)
        from launcher.train.preemption import Preempted

        if isinstance(exc, Preempted):  # checkpointed and requeued: not a failure
            logging.shutdown()
            os._exit(PREEMPTED_EXIT)
        code = exc.exit_code if isinstance(exc, LaunchError) else 1
        if isinstance(exc, SystemExit):
            code = exc.code if isinstance(exc.code, int) else 1
            if code == 0:
                raise
        try:
            failures.write_record(run_dir, world.rank, world.restart_count, exc, code)
            _record_where_rank0_reads(world, exc, code)
            if code != 2 and not isinstance(exc, ExplainedStop):  # (bad input or a NaN stop: not again)
                _requeue_after_failure(spec, run_dir, world.rank)
        except OSError as unwritten:  # (a full disk): the console still hears why
            print(f"launch: rank {world.rank} failed: {type(exc).__name__}: {exc} (its failure record could not be "
                  f"written: {unwritten})", file=sys.stderr, flush=True)
        if isinstance(exc, LaunchError):  # (its one line: the console has it from the launcher)
            logging.getLogger("launcher.worker").error("rank %d stopped: %s", world.rank, exc,
                                                       extra={"file_only": True})
        else:
            logging.getLogger("launcher.worker").error("rank %d failed: %s: %s", world.rank, type(exc).__name__, exc,
                                                       exc_info=exc, extra={"file_only": True})
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        # Exit now: a process group torn down politely can block on peers that are already gone.
        os._exit(code)
