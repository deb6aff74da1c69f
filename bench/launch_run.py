"""Run `launch` once as a user would (a subprocess in a scratch directory) and read what it left.

Shared by the benchmark scripts in this folder.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class LaunchRun:
    exit_code: int
    wall_s: float
    output: str
    results: dict[str, Any] | None = None  # results.json, when the run finished
    metrics: list[dict[str, Any]] = field(default_factory=list)  # metrics.jsonl rows
    command_started: float = 0.0  # time.time() just before the command was started

    def first_step_from_command_s(self) -> float | None:
        """Seconds from starting the command (interpreter start-up included) to the first training step."""
        if not self.results or "started_unix" not in self.results:
            return None
        return round(self.results["started_unix"] + self.results["first_step_s"] - self.command_started, 2)

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and self.results is not None

    def error_tail(self, lines: int = 3) -> list[str]:
        return self.output.strip().splitlines()[-lines:]


def run_launch(*overrides: str, env: dict[str, str] | None = None, module: str = "launcher") -> LaunchRun:
    """`python -m MODULE overrides...` (launch's entry point was `launcher.cli` before 0.2)."""
    with tempfile.TemporaryDirectory(prefix="bench-launch-") as scratch:
        start = time.perf_counter()
        run_started = time.time()
        proc = subprocess.run([sys.executable, "-m", module, *overrides], cwd=scratch,
                              capture_output=True, text=True, env=env)
        wall = time.perf_counter() - start
        run = LaunchRun(proc.returncode, round(wall, 2), proc.stdout + proc.stderr, command_started=run_started)
        found = list(Path(scratch).glob("outputs/**/results.json"))
        if found:
            run.results = json.loads(found[0].read_text())
            metrics = found[0].parent / "metrics.jsonl"
            run.metrics = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return run
