"""The Backend interface: where a run's workers run (launcher/host/backends/__init__.py lists them)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from launcher.config import BackendConfig, Config
from launcher.host.outcome import LaunchContext, Outcome

if TYPE_CHECKING:
    from launcher.host.sweep import SweepContext, SweepJob


class Backend(ABC):
    name: ClassVar[str]

    def __init__(self, options: BackendConfig):
        self.options = options

    @abstractmethod
    def check(self, cfg: Config) -> None:
        """Everything that can be known wrong about this run before anything starts (a ConfigError):
        `launch -m` checks every run of a sweep with it before it starts the first."""

    @abstractmethod
    def run(self, cfg: Config, run_dir: Path, context: LaunchContext) -> Outcome:
        """Run (or submit) one launch whose config is checked; a LaunchError for what the user can fix."""

    @abstractmethod
    def sweep(self, jobs: list[SweepJob], context: SweepContext) -> None:
        """Run (or submit) a batch of sweep runs; call each job's `finished` as it ends (if followed)."""
