"""launch's own Hydra launcher: `launch -m` hands each batch of runs Hydra composed to their backend.

conf/config.yaml selects it (`hydra/launcher=launch`). For each run Hydra's sweeper asks for, it
composes the run's config the Hydra way (`load_sweep_config`), checks it (a bad value fails the whole
sweep before anything starts, exit 2), and gives the runs to their backend: backend=local runs them
side by side on free GPUs (launcher/host/packing.py), backend=slurm submits job arrays
(launcher/host/backends/slurm.py). Each run's JobReturn carries its `sweep.objective` (or the reason it
failed), so any sweeper works: the basic one, or Optuna optimizing that value. After each batch the
sweep's summary is written (launcher/host/sweep.py); the `launch` command exits with the worst exit
code of its runs.

Another `hydra/launcher` (basic, joblib, submitit_local, submitit_slurm) also works: every run then
trains where that launcher runs it, in-process (no GPU packing, no summary). What cannot work there,
backend=slurm (each of those runs would submit a SLURM job of its own), is refused by the CLI.
Hydra finds launchers in the `hydra_plugins` package: ours is launcher/host/hydra_plugins/launcher_sweep.
"""

from __future__ import annotations

import copy
import sys
import time
from pathlib import Path
from typing import Any

from hydra.core.utils import setup_globals
from hydra.plugins.launcher import Launcher
from omegaconf import OmegaConf, open_dict, read_write

from launcher.errors import LaunchError
from launcher.files import SWEEP_MARK, write_json
from launcher.host import backends
from launcher.host.compose import settled, typed
from launcher.host.outcome import RunFailed
from launcher.host.run_here import refuse_finished_run_dir
from launcher.host.sweep import SweepContext, SweepJob, report, run_sweep_job
from launcher.lifetime import let_ctrl_c_through
from launcher.strategies import float8
from launcher.world import existing_world


class SweepLauncher(Launcher):
    def __init__(self) -> None:
        self.config: Any = None
        self.hydra_context: Any = None
        self.task_function: Any = None
        self.jobs: list[SweepJob] = []  # every run of the sweep so far: a sweeper may call launch() once per batch

    def setup(self, *, hydra_context: Any, task_function: Any, config: Any) -> None:
        self.config = config
        self.hydra_context = hydra_context
        self.task_function = task_function

    def launch(self, job_overrides: Any, initial_job_idx: int) -> list:
        setup_globals()
        sweep_dir = Path(str(self.config.hydra.sweep.dir)).resolve()
        sweep_dir.mkdir(parents=True, exist_ok=True)
        if not (sweep_dir / SWEEP_MARK).exists():  # (its runs are one sweep's: trackers group them by it)
            write_json(sweep_dir / SWEEP_MARK, {"sweep_dir": str(sweep_dir), "started_unix": round(time.time(), 3)})
        jobs = [self._compose(num, list(overrides)) for num, overrides in enumerate(job_overrides, initial_job_idx)]
        inline = existing_world() is not None  # inside torchrun/srun every rank runs the sweep, here
        returns: dict[int, Any] = {}
        for job in [j for j in jobs if j.cfg.dry_run or inline]:  # nothing to place: run here
            returns[job.num] = run_sweep_job(self.hydra_context, self.task_function, job.config)
        placed = [j for j in jobs if j.num not in returns]
        context = SweepContext(self.hydra_context, self.task_function, sweep_dir)
        by_backend: dict[str, list[SweepJob]] = {}
        for job in placed:
            by_backend.setdefault(job.cfg.backend.name, []).append(job)
        owner = getattr(self.task_function, "__self__", None)  # the `launch` command's Invocation
        let_ctrl_c_through("torch")  # every run is composed: launch's own code from here (cli.main held it)
        try:
            for group in by_backend.values():
                backends.for_config(group[0].cfg.backend).sweep(group, context)
        except KeyboardInterrupt:  # Ctrl-C: the runs were stopped; say what had finished, then exit 130
            self.jobs += placed
            for job in placed:
                if job.exit_code is None and job.started:
                    job.finished(130, "stopped by Ctrl-C")
                elif job.exit_code is None:
                    job.error = "not started (Ctrl-C)"
            report(self.jobs, sweep_dir)
            raise
        self.jobs += placed
        for job in placed:
            if job.exit_code is not None and hasattr(owner, "record"):
                owner.record(job.exit_code)
        unscored = [j.num for j in placed if j.exit_code == 0 and j.objective is None]
        if unscored:
            key = placed[0].cfg.sweep.objective
            print(f"sweep: runs {unscored} have no `{key}` in their results.json (sweep.objective={key}): they "
                  "return nothing to the sweeper", file=sys.stderr, flush=True)
        if self.jobs and all(j.exit_code is not None for j in self.jobs):
            report(self.jobs, sweep_dir)
        elif placed:
            print("launch: not waiting (backend.wait=false); the summary is written by a sweep run with "
                  "backend.wait=true", flush=True)
        failed = [j for j in placed if j.exit_code not in (None, 0)]
        if failed:  # the sweep ends here, as Hydra's sweepers end it on a failed run, minus their extra line
            worst = max(failed, key=lambda j: j.exit_code or 0)
            raise RunFailed(worst.exit_code or 1, f"sweep run {worst.num} failed: {worst.error or 'see its output'}")
        return [returns[j.num] if j.num in returns else j.job_return() for j in jobs]

    def _compose(self, num: int, overrides: list[str]) -> SweepJob:
        config = self.hydra_context.config_loader.load_sweep_config(self.config, overrides)
        with open_dict(config):
            config.hydra.job.id = num
            config.hydra.job.num = num
        task = copy.deepcopy(config)
        with read_write(task), open_dict(task):
            del task["hydra"]
        run_dir = Path(str(OmegaConf.select(config, "hydra.sweep.dir"))) / str(OmegaConf.select(config,
                                                                                                "hydra.sweep.subdir"))
        try:
            cfg = typed(settled(task, overrides))
            cfg.check()
            backends.for_config(cfg.backend).check(cfg)
            float8.check_config(cfg)  # (perf.precision=fp8 on the CPU, or without torchao)
            refuse_finished_run_dir(run_dir.resolve(), "hydra.sweep.dir")  # (pointing at an earlier sweep)
        except LaunchError as err:  # one bad run fails the sweep before anything starts
            raise LaunchError(f"{err} [sweep run {num}: {' '.join(overrides)}]") from None
        return SweepJob(num, overrides, config, cfg, run_dir.resolve())
