"""`launch`: a thin Hydra entry point around launcher.run.run().

    launch [key=value ...]          one run (Hydra overrides; `launch --help` lists them)
    launch -m key=a,b,c ...         a sweep, one run after another
    launch doctor                   an environment report
    launch --cfg job                the composed config, nothing started

Hydra's own error output is a traceback or a block of text; here every error a user can fix becomes
one line on stderr and exit code 2.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import time
from pathlib import Path

from launcher.errors import describe_hydra_error

# Exit codes of the runs of this invocation (several in a sweep); the worst one is the process's.
_exit_codes: list[int] = []
_started_at: float | None = None  # when `launch` began; the first run's time-to-first-step counts from it
_sweep = None  # launcher.sweep.LocalSweep of a `launch -m` on this host, made at its first job
_slurm_sweep: list = []  # (num, cfg, run_dir, overrides) of a `launch -m ... backend=slurm`, submitted at the end
_sweep_dir: Path | None = None


def _task(cfg) -> None:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from launcher.run import run

    global _sweep_dir
    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    sweep = _sweep_backend(cfg) if hydra_cfg.mode == RunMode.MULTIRUN else None
    if sweep is not None:
        _sweep_dir = Path(hydra_cfg.sweep.dir).resolve()
        if sweep == "local":
            _start_sweep_job(cfg, hydra_cfg, run_dir)
        else:
            from launcher.config import validate

            validate(cfg)  # a bad value fails the sweep before anything is submitted
            _slurm_sweep.append((hydra_cfg.job.num, cfg, run_dir.resolve(), list(hydra_cfg.overrides.task)))
        return
    outcome = run(cfg, run_dir, started=_started_at if not _exit_codes else time.time(),
                  overrides=list(hydra_cfg.overrides.task))
    _remove_if_only_hydra_files(run_dir)  # a dry run, or input refused before anything started
    if outcome.error:
        print(f"launch: {outcome.error}", file=sys.stderr, flush=True)
    _exit_codes.append(outcome.exit_code)
    if outcome.exit_code and hydra_cfg.mode != RunMode.MULTIRUN:
        raise SystemExit(outcome.exit_code)


def _sweep_backend(cfg) -> str | None:
    """How a `launch -m` job runs: "local" (a child launch, side by side: launcher/sweep.py), "slurm"
    (an element of one job array, submitted after the last job), None (here, in this process)."""
    from launcher.distenv import existing_world

    if cfg.dry_run or existing_world() is not None:
        return None
    return cfg.backend.name


def _start_sweep_job(cfg, hydra_cfg, run_dir: Path) -> None:
    global _sweep
    from omegaconf import OmegaConf

    from launcher.sweep import LocalSweep, SweepJob, gpu_request

    if _sweep is None:  # GPUs are counted once per sweep
        from launcher.gpus import physical_gpu_count, visible_devices

        _sweep = LocalSweep(len(visible_devices(os.environ, physical_gpu_count())), parallel=cfg.sweep.parallel)
    gpus = OmegaConf.to_container(cfg.gpus) if OmegaConf.is_config(cfg.gpus) else cfg.gpus
    job = SweepJob(hydra_cfg.job.num, list(hydra_cfg.overrides.task), run_dir,
                   gpu_request(gpus, cfg.strategy.name, _sweep.pool.visible))
    _sweep.submit(job)


def _finish_sweep() -> None:
    from launcher.sweep import report

    jobs = _sweep.wait_all()
    _exit_codes.extend(job.exit_code or 0 for job in jobs)
    report(jobs, _sweep_dir)


def _remove_if_only_hydra_files(run_dir: Path) -> None:
    """A launch that started nothing should leave nothing: drop the dir Hydra made if it holds only .hydra/."""
    entries = {p.name for p in run_dir.iterdir()} if run_dir.is_dir() else set()
    if entries <= {".hydra"}:
        shutil.rmtree(run_dir, ignore_errors=True)
        stop = Path.cwd().resolve()
        for parent in run_dir.resolve().parents:  # outputs/DATE/ too, when this run was all they held
            if parent == stop or not parent.is_relative_to(stop):
                break
            try:
                parent.rmdir()
            except OSError:
                break


def _joined_overrides(argv: list[str]) -> list[str]:
    """Inside torchrun/srun every rank runs `launch`: give them one shared run dir, written by rank 0."""
    from launcher.distenv import existing_world, joined_run_id

    world = existing_world()
    if world is None:
        return []
    extra = []
    if not any(a.startswith("hydra.run.dir=") for a in argv):
        extra.append(f"hydra.run.dir=outputs/{joined_run_id(os.environ)}")
    if world.rank != 0:
        extra.append("hydra.output_subdir=null")
    return extra


def _script_args_as_override(argv: list[str]) -> list[str]:
    """`launch script=train.py ... -- --lr 0.1`: what follows `--` becomes script_args, quoted so that
    Hydra and OmegaConf hand every word back unchanged (quotes, backslashes, `${...}` included)."""
    if "--" not in argv:
        return argv
    cut = argv.index("--")

    def quoted(word: str) -> str:
        word = word.replace("${", "\\${")  # not an interpolation
        word = re.sub(r"(\\+)(?='|$)", lambda m: m.group(1) * 2, word)  # backslashes Hydra would read as escapes
        return "'" + word.replace("'", "\\'") + "'"

    return [*argv[:cut], "script_args=[" + ",".join(quoted(w) for w in argv[cut + 1:]) + "]"]


def _user_recipe_overrides(argv: list[str]) -> list[str]:
    """`recipe=my_pkg.my_recipe` (a module, not one of the built-in recipe configs) means recipe.name=that
    module, on top of the default recipe's settings, with its first model unless recipe.model is given."""
    import importlib

    out = []
    for arg in argv:
        key, _, value = arg.partition("=")
        if key == "recipe" and "." in value and "," not in value:
            out.append(f"recipe.name={value}")
            if not any(a.startswith("recipe.model=") for a in argv):
                from launcher.recipes import _allow_imports_from_cwd

                _allow_imports_from_cwd()
                try:
                    models = getattr(importlib.import_module(value), "MODELS", None)
                except ImportError:
                    models = None  # the recipe check names the problem once the config is composed
                if models:
                    out.append(f"recipe.model={models[0]}")
        else:
            out.append(arg)
    return out


def _will_spawn_workers(argv: list[str]) -> bool:
    """A cheap guess from the command line: skip the worker interpreter for help, --cfg, dry runs and
    inside torchrun/srun (no spawning there). A wrong guess costs only time, never correctness."""
    from launcher.distenv import existing_world

    # (-m: a sweep here starts each run as a child launch, which has its own)
    informational = {"--help", "-h", "--hydra-help", "--cfg", "-c", "--info", "-i", "--resolve", "-m", "--multirun"}
    if informational & set(argv) or any(a.replace(" ", "").lower() in ("dry_run=true", "backend=slurm")
                                        for a in argv):
        return False  # nothing to spawn here (backend=slurm: the job's tasks do)
    return existing_world() is None


def main(argv: list[str] | None = None) -> None:
    global _started_at
    _started_at = time.time()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["doctor"]:
        from launcher.doctor import main as doctor_main

        raise SystemExit(doctor_main(argv[1:]))

    from launcher.bytecode import enable as keep_bytecode

    note = keep_bytecode()  # before any heavy import here or in the processes started below
    if note:
        print(note, file=sys.stderr, flush=True)
    if _will_spawn_workers(argv):
        from launcher.spawn import prestart_worker_interpreter

        prestart_worker_interpreter()  # imports torch in the background while Hydra composes

    import hydra

    from launcher.config import register

    register()
    os.environ["HYDRA_FULL_ERROR"] = "1"  # let Hydra's errors reach us; they are reworded below
    argv = _script_args_as_override(argv)
    argv = _user_recipe_overrides(argv)
    argv += _joined_overrides(argv)
    entry = hydra.main(config_path="pkg://launcher.conf", config_name="config", version_base="1.3")(_task)
    saved_argv = sys.argv
    sys.argv = [saved_argv[0] if saved_argv else "launch", *argv]
    try:
        entry()
    except Exception as exc:  # noqa: BLE001 - anything Hydra or OmegaConf raises at compose time
        if os.environ.get("LAUNCH_DEBUG"):
            raise
        print(f"launch: {describe_hydra_error(exc)}", file=sys.stderr)
        raise SystemExit(2) from None
    finally:
        sys.argv = saved_argv
    if _sweep is not None:
        _finish_sweep()
    if _slurm_sweep:
        from launcher.slurm import submit_sweep

        _exit_codes.append(submit_sweep(_slurm_sweep, _sweep_dir))
    if _exit_codes and max(_exit_codes):
        failed = sum(1 for c in _exit_codes if c)
        if len(_exit_codes) > 1:
            print(f"launch: {failed} of {len(_exit_codes)} sweep runs failed", file=sys.stderr)
        raise SystemExit(max(_exit_codes))


if __name__ == "__main__":
    main()
