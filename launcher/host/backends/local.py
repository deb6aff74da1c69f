"""backend=local: the workers run on this host (launcher/host/run_here.py); a sweep's runs side by side
on free GPUs (launcher/host/packing.py)."""

from __future__ import annotations

from pathlib import Path

from launcher.config import Config
from launcher.errors import ConfigError
from launcher.host.backends.base import Backend
from launcher.host.outcome import LaunchContext, Outcome
from launcher.host.packing import SideBySide
from launcher.host.plan import make_plan
from launcher.host.run_here import check_runnable, run_here
from launcher.host.sweep import SweepContext, SweepJob
from launcher.world import existing_world


class LocalBackend(Backend):
    name = "local"

    def check(self, cfg: Config) -> None:
        if cfg.nodes > 1:  # (a sweep's runs; a single launch over several machines is checked by its plan)
            raise ConfigError("nodes", cfg.nodes, "a sweep (launch -m) runs on this machine; run each launch over "
                              "several machines by itself, or sweep on SLURM with backend.nodes",
                              "-m backend=slurm backend.nodes=2 batch_size=256,512")
        make_plan(cfg, existing_world())  # devices, strategy, batch split, on this host
        check_runnable(cfg)

    def run(self, cfg: Config, run_dir: Path, context: LaunchContext) -> Outcome:
        return run_here(cfg, run_dir, context)

    def sweep(self, jobs: list[SweepJob], context: SweepContext) -> None:
        SideBySide(context.hydra_context, context.task_function, jobs[0].cfg.sweep.parallel).run(jobs)
