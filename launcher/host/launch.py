"""One launch, from a typed config to an Outcome: check it, then its backend runs it (here, or on SLURM).

Importable and tested without the CLI: `launch(cfg, run_dir, LaunchContext(started=time.time()))`.
"""

from __future__ import annotations

from pathlib import Path

from launcher.config import Config
from launcher.errors import LaunchError
from launcher.host import backends
from launcher.host.outcome import LaunchContext, Outcome


def launch(cfg: Config, run_dir: Path, context: LaunchContext) -> Outcome:
    """Run `cfg` (typed and checked: cli.py checks it before torch is imported) into `run_dir`. Errors a
    user can fix come back as exit code 2 with one line, before any worker starts wherever the launcher
    can tell."""
    try:
        return backends.for_config(cfg.backend).run(cfg, Path(run_dir).resolve(), context)
    except LaunchError as err:
        return Outcome(err.exit_code, error=str(err))
