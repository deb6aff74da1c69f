"""One launch on this host: plan, start (or join) the workers, supervise them, report.

    plan (devices, strategy, worker env) -> dry run? -> prepare data once -> workers -> summary

backend=local runs this in the `launch` process; backend=slurm runs it in every task of the job. The
run dir is the one Hydra made for this launch (or the SLURM job's); workers write into it and never
create their own.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING

from launcher import logs
from launcher.config import Config, Toggle, derive, model_name
from launcher.data.cache import prepare_inductor_dir
from launcher.errors import LaunchError
from launcher.failures import span
from launcher.files import (
    CHECKPOINTS,
    CONFIG,
    CURVES,
    LOG,
    NODE,
    OUTCOME,
    PINNED,
    PLAN,
    RESULTS,
    TENSORBOARD,
    DiskFull,
    last_checkpoint,
    read_json,
    write_json,
)
from launcher.host import disk, memory, script, trackers
from launcher.host.compose import to_yaml
from launcher.host.evaluate import checkpoint_to_evaluate, pin, unpin
from launcher.host.evaluate import summarize as summarize_evaluation
from launcher.host.outcome import LaunchContext, Outcome, signal_name
from launcher.host.plan import Plan, make_plan
from launcher.host.resume import Resume, check_classes, check_network, typed_keys
from launcher.host.resume import inspect as inspect_resume
from launcher.host.resume import resolve as resolve_resume
from launcher.spec import WorkerSpec
from launcher.strategies import float8
from launcher.world import existing_world

if TYPE_CHECKING:
    from launcher.host.spawn import StopSignals
    from launcher.recipes import Recipe

log = logging.getLogger("launcher")


def check_runnable(cfg: Config) -> type[Recipe] | None:
    """What can be checked of the run itself before anything starts: the script exists, or the recipe
    imports, has the model named and the figures that settings name (where it can say them up front).
    Returns the recipe's class (None for a script)."""
    if cfg.script:
        script.script_path(cfg)
        return None
    from launcher import models
    from launcher.recipes import check_figures, check_model, recipe_class

    recipe = recipe_class(cfg.recipe.name)
    if models.configured(cfg.model):
        models.check(cfg.model)  # (the recipe's own models are not built then)
    else:
        check_model(recipe, cfg)
    check_figures(recipe, cfg)
    return recipe


def run_here(cfg: Config, run_dir: Path, context: LaunchContext) -> Outcome:
    """Run `cfg` (checked) on this host into `run_dir`. Errors a user can fix come back as exit code 2."""
    run_dir = Path(run_dir).resolve()
    try:
        prepare_inductor_dir()  # (refused once more where the forkserver was not started for it)
        joined = existing_world()
        requeued = context.requeue is not None and context.requeue.requeued
        if joined is None and not requeued:
            refuse_finished_run_dir(run_dir)
        plan = make_plan(cfg, joined)
        if cfg.script:
            return _run_user_script(plan, run_dir, context)
        recipe = check_runnable(cfg)
        float8.check(plan)  # (perf.precision=fp8: GPUs that have float8 matmuls, and torchao)
        evaluate, checked, classes = checkpoint_to_evaluate(cfg) if cfg.eval.checkpoint else (None, None, None)
        fits, fit = None, None
        if recipe is not None and evaluate is None and (joined is None or joined.local_rank == 0):
            fit = memory.check_fits(recipe(plan.config), plan)  # (training: once a host, before its data and workers)
            chosen = plan.strategy.fit_memory(fit.spare_bytes, fit.parameters)  # (it travels to the workers)
            fits = "; ".join(said for said in (fit.line, chosen) if said) or None
        if evaluate is None:  # (every tracker log=[...] picks works here, or goes with a warning)
            tracked, untracked = trackers.check(plan.config)
            plan = dataclasses.replace(plan, config=tracked, notes=(*plan.notes, *untracked))
        if evaluate is not None:  # one pass over the test split: compiling would cost more than it saves
            uncompiled = derive(plan.config.perf, compile=Toggle.false)
            plan = dataclasses.replace(plan, config=derive(plan.config, perf=uncompiled))
        resume = inspect_resume(cfg.resume, plan.config) if cfg.resume and not requeued else None
        if resume is not None and recipe is not None and (joined is None or joined.local_rank == 0):
            check_network(recipe(plan.config), resume, str(cfg.resume))  # (its weights fit this config's network)
        resume_from = str(resume.path) if resume else (str(resolve_resume(cfg.resume).resolve()) if cfg.resume
                                                       else None)
        room = None
        if fit is not None and not requeued:  # (a requeued run's own checkpoints hold their room already)
            room = disk.check_room(plan, run_dir, fit, cfg.epochs - (resume.epoch if resume else 0))
        if cfg.dry_run:
            print(describe_dry_run(plan, run_dir, resume, evaluate, fits, room))
            return Outcome(0)
        if recipe is not None and (joined is None or joined.local_rank == 0):
            prepared = recipe(plan.config)
            prepared.prepare()  # fetch or check data once per host
            check_classes(resume.classes if resume else classes, prepared.data_classes(),
                          f"resume={cfg.resume}" if resume else f"eval.checkpoint={cfg.eval.checkpoint}",
                          plan.config.data.root)
    except LaunchError as err:
        return Outcome(err.exit_code, error=str(err))

    from torch.distributed.elastic.multiprocessing.api import SignalException

    from launcher.host.spawn import StopSignals

    is_main = joined is None or joined.rank == 0
    debug = bool(os.environ.get("LAUNCH_DEBUG"))
    with StopSignals() as stops:  # (from the run dir's first file on, a stop is recorded as one)
        try:
            outcome = _start(plan, cfg, run_dir, context, resume, resume_from, evaluate, checked, is_main, debug,
                             stops)
        except (SignalException, KeyboardInterrupt) as stop:  # before elastic's agent took the signals over
            signum = signal.Signals(getattr(stop, "sigval", signal.SIGINT))
            outcome = Outcome(128 + signum, error=f"stopped by {signum.name}: before the workers started; what "
                              f"was written is in {run_dir}", stopped=True)
        stops.hold()
        if plan.joined is not None:  # this process was a worker too: back to the launcher's own logging
            logs.setup_launcher_logging(run_dir if is_main else None, debug=debug)
        if is_main:
            _record_outcome(run_dir, outcome)
    if stops.unacted is not None and not outcome.stopped:  # (it came while the outcome was written)
        os.kill(os.getpid(), stops.unacted)
    if outcome.exit_code == 0 and outcome.node_ranks:
        summarize_other_node(outcome.node_ranks, run_dir, time.time() - context.started)
    elif outcome.exit_code == 0 and is_main:
        (summarize_evaluation if evaluate else summarize)(outcome.results, run_dir, time.time() - context.started)
    return outcome


def _start(plan: Plan, cfg: Config, run_dir: Path, context: LaunchContext, resume: Resume | None,
           resume_from: str | None, evaluate: Path | None, checked, is_main: bool, debug: bool,
           stops: StopSignals) -> Outcome:
    """Write the run dir's files, then start (or, in a SLURM task, be) the workers and supervise them."""
    run_dir.mkdir(parents=True, exist_ok=True)
    logs.setup_launcher_logging(run_dir if is_main else None, debug=debug)
    if is_main:
        _write_run_files(plan, run_dir, resume, context)
        target = (cfg.model or {}).get("_target_")  # (a network from config is named: the recipe's own is not)
        log.info("%s: %s", f"{cfg.recipe.name} ({model_name(cfg)})" if target else cfg.recipe.name, plan.describe())
        if resume is not None:
            log.info(resume.describe())
        if plan.gpu_choice:
            log.info(plan.gpu_choice)
        log.info("run dir: %s", run_dir)
        for note in plan.notes:
            log.warning(note)
    if plan.network is not None:
        others = "the other nodes" if plan.config.node_rank in (None, 0) else "node 0 and the others"
        log.info("waiting for %s at %s:%s (rdzv_timeout_s=%d); the same launch starts each, with its own node_rank",
                 others, plan.network.rdzv_address, plan.network.rdzv_port, plan.config.rdzv_timeout_s)

    pinned = None  # (launch eval: the checkpoint held still while the workers read it; not where each rank
    if evaluate is not None and plan.joined is None:  # is a process of its own, started by srun)
        try:
            pinned = pin(evaluate, checked, run_dir / PINNED, f"launch eval {cfg.eval.checkpoint}")
        except LaunchError as err:
            return Outcome(err.exit_code, error=str(err))
    spec = WorkerSpec(plan.config, plan.strategy, str(run_dir), plan.env, plan.device_index, resume_from,
                      evaluate=str(evaluate) if evaluate else None, evaluate_read=str(pinned) if pinned else None,
                      requeue=context.requeue, started_at=context.started,
                      spawned_s=round(time.time() - context.started, 3),
                      typed=tuple(sorted(typed_keys(context.overrides))))
    try:
        outcome = _execute(spec, plan, stops)
    finally:
        if pinned is not None:
            unpin(run_dir / PINNED)
    return outcome


def _record_outcome(run_dir: Path, outcome: Outcome) -> None:
    """How the run ended, for `launch runs` (stopped by a signal, failed, finished) and for scripts. A
    launch killed outright (SIGKILL, power) writes none: its run reads as failed."""
    code = outcome.exit_code
    try:
        write_json(run_dir / OUTCOME, {"exit_code": code, "stopped_by": signal_name(code), "error": outcome.error,
                                       "ended": time.strftime("%Y-%m-%d %H:%M:%S")})
    except (OSError, DiskFull) as exc:  # (a full disk: said, and the run's own error and exit code kept)
        log.warning("%s could not be written (%s); the exit code is %d", run_dir / OUTCOME,
                    getattr(exc, "strerror", None) or str(exc).split(";")[0], code)


def _execute(spec: WorkerSpec, plan: Plan, stops: StopSignals) -> Outcome:
    if plan.joined is not None:
        from launcher.train.worker import worker_main  # this process is one rank: it trains here

        stops.raising()
        return Outcome(0, results=worker_main(spec))  # worker_main exits the process on failure
    from launcher.host.spawn import launch_local

    return launch_local(spec, plan.strategy.processes, plan.config.max_restarts, nodes_of(plan), stops)


def nodes_of(plan: Plan):
    """This node's part in a launch over several machines (spawn.Nodes), or None."""
    if plan.network is None:
        return None
    from launcher.host.rendezvous import STORE_READ_TIMEOUT_S
    from launcher.host.spawn import Nodes

    cfg = plan.config
    # A node cut off from the rendezvous gives up on it after the collectives' own timeout, 10-30 s
    collective_s = getattr(cfg.strategy, "timeout_s", STORE_READ_TIMEOUT_S)
    return Nodes(cfg.nodes, cfg.node_rank, plan.network, cfg.rdzv_timeout_s,
                 store_read_s=min(STORE_READ_TIMEOUT_S, max(10, collective_s)))


def _run_user_script(plan: Plan, run_dir: Path, context: LaunchContext) -> Outcome:
    """script=...: the user's torchrun-style script on the planned devices (launcher/host/script.py)."""
    cfg = plan.config
    path = script.script_path(cfg)
    argv = script.script_argv(cfg)
    if not plan.strategy.runs_scripts:
        raise LaunchError(f"strategy={plan.strategy.name} is not valid with script={cfg.script}: a script runs one "
                          "process per device and wraps its model itself (e.g. launch script=train.py gpus=[0,1])")
    command = " ".join(["python", str(path), *argv])
    if cfg.dry_run:
        print(f"dry run: nothing started. {command}\n  on {plan.describe(with_batch=False)}\n  worker env " +
              " ".join(f"{k}={v!r}" for k, v in sorted(plan.env.items())))
        return Outcome(0)
    is_main = plan.joined is None or plan.joined.rank == 0
    run_dir.mkdir(parents=True, exist_ok=True)
    logs.setup_launcher_logging(run_dir if is_main else None, debug=bool(os.environ.get("LAUNCH_DEBUG")))
    if is_main:
        _write_run_files(plan, run_dir, None, context, script_command=[str(path), *argv])
        log.info("script: %s on %s", command, plan.describe(with_batch=False))  # (batch size is the script's)
    if plan.joined is not None:  # inside torchrun/srun: this process is one rank; run the script here
        return script.run_in_this_process(path, argv, plan.env, plan.joined.rank)
    outcome = script.run_script(path, argv, run_dir, plan.strategy.processes, plan.env, cfg.max_restarts,
                                nodes_of(plan))
    if is_main:
        _record_outcome(run_dir, outcome)
    if outcome.exit_code == 0:
        log.info("done in %.1fs: %s finished on every rank. Output of each rank: %s  log: %s",
                 time.time() - context.started, path.name, run_dir / "logs", run_dir / LOG)
    return outcome


def refuse_finished_run_dir(run_dir: Path, setting: str = "hydra.run.dir") -> None:
    """A run dir named by hand (`setting`=...) may already hold a run; never write over it."""
    if (run_dir / RESULTS).exists() or last_checkpoint(run_dir).exists():
        shown = f"{setting}={run_dir}" if setting == "hydra.run.dir" else f"the run dir {run_dir}"
        raise LaunchError(f"{shown} already holds a run: continue it with resume={run_dir} in a new dir, or pick "
                          f"another {setting}")


def _write_run_files(plan: Plan, run_dir: Path, resume: Resume | None, context: LaunchContext,
                     script_command: list[str] | None = None) -> None:
    (run_dir / CONFIG).write_text(to_yaml(plan.config))
    record = {**plan.record(), "resume_from": str(resume.path) if resume else None,
              "resume": resume.record() if resume else None, "overrides": list(context.overrides)}
    if script_command:
        record["script_command"] = script_command
    (run_dir / PLAN).write_text(json.dumps(record, indent=2) + "\n")


def describe_dry_run(plan: Plan, run_dir: Path, resume: Resume | None, evaluate: Path | None = None,
                     fits: str | None = None, room: str | None = None) -> str:
    cfg, s = plan.config, plan.strategy
    how = "torch.distributed.elastic, c10d rendezvous on localhost:0" if plan.joined is None else "already started"
    if plan.network is not None:
        how = f"torch.distributed.elastic on each of {cfg.nodes} nodes, c10d {plan.network.describe()}"
    lines = [
        f"dry run: nothing started. {cfg.recipe.name} ({model_name(cfg)}): {plan.describe()}",
        *([f"  gpus          {plan.gpu_choice}"] if plan.gpu_choice else []),
        f"  workers       {s.processes} process{'es' if s.processes > 1 else ''} ({how})",
        "  worker env    " + " ".join(f"{k}={v!r}" for k, v in sorted(plan.env.items())),
        f"  training      epochs={cfg.epochs} batch_size={cfg.batch_size} (global) lr={cfg.lr} seed={cfg.seed}",
        "  data          " + ("synthetic (data.synthetic=true)" if cfg.data.synthetic else f"root={cfg.data.root}")
        + f", placement={cfg.data.placement}",
        f"  run dir       {run_dir} (not created)",
    ]
    if resume:
        lines.append(f"  resume        {resume.describe()}")
    if evaluate:
        lines.append(f"  evaluate      {evaluate} (no training)")
    if fits:
        lines.append(f"  memory        {fits}")
    if room or not cfg.saves:
        lines.append(f"  checkpoints   {room or 'none (checkpoint=false)'}")
    lines += [f"  note          {note}" for note in plan.notes]
    return "\n".join(lines)


def summarize_other_node(ranks: list[int], run_dir: Path, elapsed: float) -> None:
    """The last line on a node without rank 0: its ranks finished; the run's results are rank 0's."""
    main = read_json(run_dir / NODE).get("main_run_dir")
    where = f"rank 0's run dir {main}" if main else "rank 0's run dir, on its node"
    log.info("done in %.1fs: this node's ranks %s finished; results, metrics and checkpoints are in %s. "
             "This node's log: %s", elapsed, ", ".join(map(str, ranks)) if len(ranks) < 3 else span(ranks), where,
             run_dir / LOG)


def summarize(results: dict | None, run_dir: Path, elapsed: float) -> None:
    """The launch's last line: the result, and where everything is."""
    results = results or {}
    acc = results.get("test_acc")
    final = results.get("final") or {}
    figures = {k: v for k, v in final.items() if k.startswith("test_") and isinstance(v, (int, float))}
    acc_text = f"test accuracy {100 * acc:.2f}%" if isinstance(acc, float) else "no epochs trained"
    if not isinstance(acc, float) and figures:  # a recipe's own figures: the objective first
        objective = results.get("objective")
        order = sorted(figures, key=lambda k: k != objective)
        acc_text = ", ".join(f"{k} {figures[k]:.4g}" for k in order[:4])
    elif not isinstance(acc, float) and final:
        acc_text = f"training loss {final.get('loss', float('nan')):.4g} (no evaluation)"
    bpb, ppl = final.get("test_bpb"), final.get("test_ppl")
    # (a language model: what predicting the training tokens' frequencies alone gives, a model must beat it)
    unigram = results.get("unigram_test_bpb" if isinstance(bpb, float) else "unigram_test_ppl")
    figure = bpb if isinstance(bpb, float) else ppl  # (neither, where the last epoch was not evaluated)
    short = (" - not past it yet: more epochs, data or a higher lr" if isinstance(unigram, float)
             and isinstance(figure, float) and figure >= unigram else "")
    if isinstance(bpb, float):  # on bytes: bits per byte
        acc_text = f"held-out {bpb:.3f} bits/byte (unigram baseline {unigram or 0.0:.3f}{short})"
    if isinstance(ppl, float):  # on token shards: perplexity (bits per byte would need the tokenizer)
        acc_text = (f"held-out loss {final.get('test_loss', 0.0):.3f}, perplexity {ppl:.1f} (unigram baseline "
                    f"{unigram or 0.0:.1f}{short})")
    timed = results.get("timed") or {}
    if timed.get("train_eval_s"):
        acc_text += f", training + evaluation {timed['train_eval_s']:.2f}s ({timed['clock']})"
    stopped = results.get("stopped_early")
    if isinstance(stopped, dict):  # (early_stop: exit 0, said here as in the epoch line and results.json)
        acc_text = f"stopped early after epoch {stopped.get('epoch')} of {results.get('epochs')}, {acc_text}"
    kept = (results.get("best_checkpoint") or {}).get("kept") or []
    if kept:
        best = kept[0]
        acc_text += (f"; best.pt: epoch {best['epoch']} ({results['best_checkpoint']['metric']} {best['value']:.4g}, "
                     f"launch eval {run_dir} best)")
    offline = sorted((run_dir / "wandb").glob("offline-run-*"))
    if offline:  # (log=[wandb], offline: nothing was sent)
        acc_text += f"; W&B offline: wandb sync {offline[-1]}"
    curves = run_dir / CURVES
    checkpoints = run_dir / CHECKPOINTS
    log.info("done in %.1fs: %s. results: %s  %slog: %s%s%s", elapsed, acc_text, run_dir / RESULTS,
             f"checkpoints: {checkpoints}  " if checkpoints.is_dir() else "", run_dir / LOG,
             f"  curves: {curves}" if curves.exists() else "",
             f"  tensorboard --logdir {run_dir}" if (run_dir / TENSORBOARD).is_dir() else "")
    if results and results.get("ranks_agree") is False:
        log.warning("the ranks ended with different weights: see weights_sha256 in results.json")
