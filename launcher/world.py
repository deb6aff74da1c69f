"""The torch.distributed environment contract: RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
MASTER_ADDR, MASTER_PORT. Workers read their place in the world from it (WorldInfo.from_env); the
launcher recognises when it already runs inside a world (started by torchrun, or as one task of
`srun`, or another launcher's where LAUNCH_JOIN=1 says so), in which case it joins instead of spawning;
the same variables left in a shell are refused (`refused_world`). And the cores this machine's part of a
launch may use (`available_cores`: what CPU workers' threads are sized by, and what the slow-epoch hint
compares the machine's load with).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class WorldInfo:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    master_addr: str
    master_port: int
    restart_count: int = 0  # TORCHELASTIC_RESTART_COUNT: >0 after the group was restarted

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> WorldInfo:
        env = os.environ if env is None else env
        return cls(
            rank=int(env.get("RANK", 0)),
            local_rank=int(env.get("LOCAL_RANK", 0)),
            world_size=int(env.get("WORLD_SIZE", 1)),
            local_world_size=int(env.get("LOCAL_WORLD_SIZE", env.get("WORLD_SIZE", 1))),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(env.get("MASTER_PORT", 29500)),
            # elastic's restarts; in a SLURM job's tasks, its requeues (SLURM_RESTART_COUNT)
            restart_count=int(env.get("TORCHELASTIC_RESTART_COUNT") or env.get("SLURM_RESTART_COUNT") or 0),
        )

    def as_env(self) -> dict[str, str]:
        return {"RANK": str(self.rank), "LOCAL_RANK": str(self.local_rank), "WORLD_SIZE": str(self.world_size),
                "LOCAL_WORLD_SIZE": str(self.local_world_size), "MASTER_ADDR": self.master_addr,
                "MASTER_PORT": str(self.master_port)}


# What every launcher of a torch.distributed world sets for each rank
WORLD_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
# LAUNCH_JOIN=1: join the world those variables describe though no torchrun or srun started it (another
# launcher: a Kubernetes PyTorchJob, DeepSpeed's, an MPI wrapper)
JOIN = "LAUNCH_JOIN"


def started_by_torchrun(env: Mapping[str, str]) -> bool:
    """torchrun (torch.distributed.elastic's agent) names its run in every worker it starts."""
    return "TORCHELASTIC_RUN_ID" in env


def told_to_join(env: Mapping[str, str]) -> bool:
    return env.get(JOIN) == "1" and all(k in env for k in WORLD_VARS)


def refused_world(env: Mapping[str, str] | None = None) -> str | None:
    """Why `launch` will not start here, as one line, or None.

    RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT alone are what torchrun's variables look like when
    left exported in a shell: joining that world waited without a word for ranks nobody starts. A
    world is joined only where torchrun or srun started this process, or LAUNCH_JOIN=1 says so.
    """
    env = os.environ if env is None else env
    if existing_world(env) is not None:
        return None
    present = [k for k in (*WORLD_VARS, "LOCAL_RANK", "LOCAL_WORLD_SIZE") if k in env]
    if env.get(JOIN, "") not in ("", "0", "1"):
        return f"{JOIN}={env[JOIN]} is not valid: 1 (join the world {', '.join(WORLD_VARS)} describe) or 0 " \
               f"(e.g. {JOIN}=1 launch ...)"
    if env.get(JOIN) == "1":
        missing = [k for k in WORLD_VARS if k not in env]
        return f"{JOIN}=1 asks launch to join a world, but {', '.join(missing)} " \
               f"{'is' if len(missing) == 1 else 'are'} not set (each rank needs {', '.join(WORLD_VARS)}; " \
               f"`unset {JOIN}` to start launch's own workers)"
    if not all(k in env for k in WORLD_VARS):
        return None
    shown = " ".join(f"{k}={env[k]}" for k in present)
    return (f"{shown} are set, but neither torchrun nor srun started this launch (no TORCHELASTIC_RUN_ID): "
            f"joining that world would wait for ranks nobody starts. Left in this shell? "
            f"`unset {' '.join(present)}` and launch starts its own workers; another launcher's world: "
            f"{JOIN}=1 launch ... joins it")


def in_srun_with_tasks(env: Mapping[str, str]) -> bool:
    """One task of a multi-task `srun` step: SLURM started the processes, one per rank.

    The step's own task count decides, not the job's: a batch script of a `--ntasks=2` job is one
    process, and must spawn its workers rather than wait for a second rank that nobody starts.
    """
    return "SLURM_STEP_ID" in env and "SLURM_PROCID" in env and int(env.get("SLURM_STEP_NUM_TASKS", "1")) > 1


def existing_world(env: Mapping[str, str] | None = None) -> WorldInfo | None:
    """The world this process already belongs to, or None when `launch` should spawn its own workers."""
    env = os.environ if env is None else env
    if started_by_torchrun(env) or told_to_join(env):
        return WorldInfo.from_env(env)
    if in_srun_with_tasks(env):
        return _from_slurm()  # reads os.environ, as SLURM set it
    return None


def _from_slurm() -> WorldInfo:
    # submitit parses SLURM's variables (the compressed node list included). Its generic
    # JobEnvironment() only recognises jobs that submitit itself submitted, so use the SLURM one directly.
    import random

    from submitit.slurm.slurm import SlurmJobEnvironment

    job = SlurmJobEnvironment()
    # Every task must agree on a port without talking: derive it from the job id, unless one is given.
    port = int(os.environ.get("MASTER_PORT") or random.Random(job.job_id).randint(20000, 60000))
    # (a requeued job's run: the restarted attempt, as elastic's TORCHELASTIC_RESTART_COUNT says locally)
    return WorldInfo(job.global_rank, job.local_rank, job.num_tasks, job.num_tasks // job.num_nodes,
                     job.hostnames[0], port, restart_count=int(os.environ.get("SLURM_RESTART_COUNT") or 0))


def joined_run_id(env: Mapping[str, str]) -> str:
    """A name every rank of a joined world agrees on, for the one shared run dir."""
    if "TORCHELASTIC_RUN_ID" in env:
        return f"torchrun-{env['TORCHELASTIC_RUN_ID']}"
    if "SLURM_JOB_ID" in env:
        return f"slurm-{env['SLURM_JOB_ID']}-{env.get('SLURM_STEP_ID', '0')}"
    return f"world-{env.get('MASTER_ADDR', 'local')}-{env.get('MASTER_PORT', '0')}"


def available_cores(env: Mapping[str, str]) -> int:
    """Cores this launch may use: a SLURM allocation's share, else this process's CPU affinity.

    os.cpu_count() counts the whole host; two runs sharing it, each sizing its threads to all of it,
    crawled (a 3-run digits job array on the 2-core test cluster: the two runs side by side, 2 threads
    each, far slower than the third alone; seen once, before this function existed; measured: BENCHMARKS.md
    section 12).
    """
    if env.get("SLURM_CPUS_ON_NODE", "").isdigit():  # the job's CPUs on this node, all its tasks together
        return int(env["SLURM_CPUS_ON_NODE"])
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
