"""One launch, from a composed config to a finished run dir. Importable and tested without the CLI.

    validate -> plan (devices, strategy, worker env) -> dry run? -> prepare data once -> workers -> summary

The run dir is the one Hydra made for this launch; workers write into it and never create their own.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from launcher import checkpoint, distenv, logs, preemption, reporting
from launcher.config import LaunchError, validate
from launcher.plan import Plan, make_plan
from launcher.recipes import check_model, get_recipe, prepare
from launcher.spawn import Outcome
from launcher.strategy import DP_COST

log = logging.getLogger("launcher")

RESOLVED_CONFIG = "config.yaml"
PLAN = "plan.json"


def run(cfg: DictConfig, run_dir: Path, started: float | None = None, overrides: list[str] | None = None) -> Outcome:
    """Launch the run described by `cfg` into `run_dir`. Errors a user can fix come back as exit code 2.

    `started` is when the launch began (time.time()); the time to the first training step counts from it.
    `overrides` are the command line's (backend=slurm hands them to the job's tasks).
    """
    started = time.time() if started is None else started
    run_dir = Path(run_dir).resolve()
    try:
        validate(cfg)
        joined = distenv.existing_world()
        if joined is None and not preemption.requeued():
            _refuse_finished_run_dir(run_dir)
        if cfg.backend.name == "slurm" and joined is None:
            return _submit_to_slurm(cfg, run_dir, overrides or [])
        plan = make_plan(cfg, joined)
        if cfg.script:
            return _run_user_script(cfg, plan, run_dir, started)
        recipe = get_recipe(cfg.recipe.name)
        check_model(recipe, cfg)
        resume_from = str(checkpoint.resolve_resume(cfg.resume).resolve()) if cfg.resume else None
    except LaunchError as err:
        return Outcome(err.exit_code, error=str(err))
    if cfg.dry_run:
        print(describe_dry_run(cfg, plan, run_dir, resume_from))
        return Outcome(0)

    try:
        if joined is None or joined.local_rank == 0:
            prepare(recipe, cfg)  # download or check data once per host, before any worker needs it
    except LaunchError as err:
        return Outcome(err.exit_code, error=str(err))

    is_main = joined is None or joined.rank == 0
    run_dir.mkdir(parents=True, exist_ok=True)
    debug = bool(os.environ.get("LAUNCH_DEBUG"))
    logs.setup_launcher_logging(run_dir if is_main else None, debug=debug)
    if is_main:
        _write_run_files(cfg, plan, run_dir, resume_from)
        log.info("%s: %s", cfg.recipe.name, plan.describe())
        if plan.gpu_choice:
            log.info(plan.gpu_choice)
        log.info("run dir: %s", run_dir)
        if plan.layout.strategy == "dp":
            log.warning(DP_COST)

    from launcher.trainer import WorkerSpec

    spec = WorkerSpec(OmegaConf.to_container(cfg, resolve=True), str(run_dir), plan.layout, plan.env,
                      resume_from, started, spawned_s=round(time.time() - started, 3))
    outcome = _execute(spec, plan, cfg.max_restarts)
    if plan.joined is not None:  # this process was a worker too: back to the launcher's own logging
        logs.setup_launcher_logging(run_dir if is_main else None, debug=debug)
    if outcome.exit_code == 0 and is_main:
        _summarize(outcome, run_dir, time.time() - started)
    return outcome


def _submit_to_slurm(cfg: DictConfig, run_dir: Path, overrides: list[str]) -> Outcome:
    from launcher import script, slurm

    if cfg.script:
        script.script_path(cfg)  # a missing script fails here, not in every task of the job
    else:
        check_model(get_recipe(cfg.recipe.name), cfg)
    if cfg.dry_run:
        what = cfg.script if cfg.script else f"{cfg.recipe.name} ({cfg.recipe.model})"
        print(f"dry run: nothing submitted. The batch script for {what}:\n")
        print(slurm.sbatch_script(cfg, run_dir))
        return Outcome(0)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / RESOLVED_CONFIG).write_text(OmegaConf.to_yaml(cfg, resolve=True))
    return slurm.submit(cfg, run_dir, overrides)


def _run_user_script(cfg: DictConfig, plan: Plan, run_dir: Path, started: float) -> Outcome:
    """script=...: the user's torchrun-style script on the planned devices (launcher/script.py)."""
    from launcher import script

    path = script.script_path(cfg)
    argv = script.script_argv(cfg)
    if plan.layout.strategy == "dp":
        raise LaunchError(f"strategy=dp is not valid with script={cfg.script}: a script runs one process per "
                          "device and wraps its model itself (e.g. launch script=train.py gpus=[0,1])")
    command = " ".join(["python", str(path), *argv])
    if cfg.dry_run:
        print(f"dry run: nothing started. {command}\n  on {plan.describe(with_batch=False)}\n  worker env " +
              " ".join(f"{k}={v!r}" for k, v in sorted(plan.env.items())))
        return Outcome(0)
    is_main = plan.joined is None or plan.joined.rank == 0
    run_dir.mkdir(parents=True, exist_ok=True)
    logs.setup_launcher_logging(run_dir if is_main else None, debug=bool(os.environ.get("LAUNCH_DEBUG")))
    if is_main:
        _write_run_files(cfg, plan, run_dir, None)
        log.info("script: %s on %s", command, plan.describe(with_batch=False))  # (batch size is the script's)
    if plan.joined is not None:  # inside torchrun/srun: this process is one rank; run the script here
        return script.run_in_this_process(path, argv, plan.env, plan.joined.rank)
    outcome = script.run_script(path, argv, run_dir, plan.layout.nprocs, plan.env, cfg.max_restarts)
    if outcome.exit_code == 0:
        log.info("done in %.1fs: %s finished on every rank. Output of each rank: %s  log: %s",
                 time.time() - started, path.name, run_dir / "logs", run_dir / logs.LOG_NAME)
    return outcome


def _refuse_finished_run_dir(run_dir: Path) -> None:
    """A run dir named by hand (hydra.run.dir=...) may already hold a run; never write over it."""
    if (run_dir / "results.json").exists() or (checkpoint.checkpoint_dir(run_dir) / checkpoint.LAST).exists():
        raise LaunchError(f"hydra.run.dir={run_dir} already holds a run: continue it with resume={run_dir} "
                          "in a new dir, or pick another hydra.run.dir")


def _execute(spec, plan: Plan, max_restarts: int) -> Outcome:
    if plan.joined is not None:
        from launcher.worker import worker_main

        return Outcome(0, results=worker_main(spec))  # worker_main exits the process on failure
    from launcher.spawn import launch_local

    return launch_local(spec, plan.layout.nprocs, max_restarts)


def _write_run_files(cfg: DictConfig, plan: Plan, run_dir: Path, resume_from: str | None) -> None:
    (run_dir / RESOLVED_CONFIG).write_text(OmegaConf.to_yaml(cfg, resolve=True))
    lay = plan.layout
    record = {
        "strategy": lay.strategy, "device_type": lay.device_type, "nprocs": lay.nprocs,
        "gpu_ids": plan.gpu_ids, "visible_devices": plan.visible, "worker_env": plan.env,
        "global_batch": lay.global_batch, "batch_per_process": lay.batch_per_process,
        "dist_backend": lay.dist_backend, "resume_from": resume_from,
        "joined": plan.joined.as_env() if plan.joined else None,
    }
    (run_dir / PLAN).write_text(json.dumps(record, indent=2) + "\n")


def describe_dry_run(cfg: DictConfig, plan: Plan, run_dir: Path, resume_from: str | None) -> str:
    lay = plan.layout
    how = "torch.distributed.elastic, c10d rendezvous on localhost:0" if plan.joined is None else "already started"
    lines = [
        f"dry run: nothing started. {cfg.recipe.name} ({cfg.recipe.model}): {plan.describe()}",
        *([f"  gpus          {plan.gpu_choice}"] if plan.gpu_choice else []),
        f"  workers       {lay.nprocs} process{'es' if lay.nprocs > 1 else ''} ({how})",
        "  worker env    " + " ".join(f"{k}={v!r}" for k, v in sorted(plan.env.items())),
        f"  training      epochs={cfg.epochs} batch_size={cfg.batch_size} (global) lr={cfg.lr} seed={cfg.seed}",
        "  data          " + ("synthetic (data.synthetic=true)" if cfg.data.synthetic else f"root={cfg.data.root}")
        + f", placement={cfg.data.placement}",
        f"  run dir       {run_dir} (not created)",
    ]
    if resume_from:
        lines.append(f"  resume from   {resume_from}")
    if lay.strategy == "dp":
        lines.append(f"  warning       {DP_COST}")
    return "\n".join(lines)


def _summarize(outcome: Outcome, run_dir: Path, elapsed: float) -> None:
    results = outcome.results or {}
    acc = results.get("test_acc")
    acc_text = f"test accuracy {100 * acc:.2f}%" if isinstance(acc, float) else "no epochs trained"
    timed = results.get("timed") or {}
    if timed.get("train_eval_s"):
        acc_text += f", training + evaluation {timed['train_eval_s']:.2f}s ({timed['clock']})"
    curves = run_dir / reporting.CURVES
    log.info("done in %.1fs: %s. results: %s  checkpoints: %s  log: %s%s%s", elapsed, acc_text,
             run_dir / "results.json", run_dir / "checkpoints", run_dir / logs.LOG_NAME,
             f"  curves: {curves}" if curves.exists() else "",
             f"  tensorboard --logdir {run_dir}" if (run_dir / reporting.TENSORBOARD_DIR).is_dir() else "")
    if results and not results.get("ranks_agree", True):
        log.warning("the ranks ended with different weights: see weights_sha256 in results.json")
