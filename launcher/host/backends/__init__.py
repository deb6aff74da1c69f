"""Where a run's workers run: one Backend class per `backend` option, behind one small interface.

    local   LocalBackend   here: spawn (or join) the workers on this host; sweeps side by side on free GPUs
    slurm   SlurmBackend   a SLURM job through submitit, whose tasks run the same launch inside the
                           allocation; sweeps as job arrays

To add a backend: a subclass of Backend (its `run` and `sweep`), its schema in launcher/config.py (and
its line in SCHEMAS), conf/backend/<name>.yaml, and its entry in BACKENDS below.
"""

from __future__ import annotations

from launcher.config import BackendConfig, LocalBackendConfig, SlurmBackendConfig
from launcher.host.backends.base import Backend
from launcher.host.backends.local import LocalBackend
from launcher.host.backends.slurm import SlurmBackend

BACKENDS: dict[type[BackendConfig], type[Backend]] = {
    LocalBackendConfig: LocalBackend,
    SlurmBackendConfig: SlurmBackend,
}


def for_config(options: BackendConfig) -> Backend:
    return BACKENDS[type(options)](options)
