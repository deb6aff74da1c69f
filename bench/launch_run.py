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

    def said(self, marker: str) -> str:
        """The first console line holding `marker`, from the marker on ("" where none does): what an auto
        setting kept, say (`perf.cuda_graph=auto: ...`)."""
        return next((line[line.index(marker):] for line in self.output.splitlines() if marker in line), "")


def run_launch(*overrides: str, env: dict[str, str] | None = None, module: str = "launcher",
               timeout: float | None = None, files: dict[str, str] | None = None) -> LaunchRun:
    """`python -m MODULE overrides...` (launch's entry point was `launcher.cli` before 0.2). `files`: written into
    the scratch directory launch runs in first (name -> text: a recipe file, say). `timeout`: past
    it, launch is sent SIGTERM (it stops its workers) and the run is returned as it stood: exit code 124,
    the epochs it recorded, and the last lines of its train.log after its console output."""
    import signal

    with tempfile.TemporaryDirectory(prefix="bench-launch-") as scratch:
        for name, text in (files or {}).items():
            (Path(scratch) / name).write_text(text)
        start = time.perf_counter()
        run_started = time.time()
        proc = subprocess.Popen([sys.executable, "-m", module, *overrides], cwd=scratch, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, env=env)
        try:
            output, _ = proc.communicate(timeout=timeout)
            code = proc.returncode
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)
            try:
                output, _ = proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                output, _ = proc.communicate()
            code = 124
            for log in Path(scratch).glob("outputs/**/train.log"):
                output += f"\n--- {log.name}, last lines\n" + "\n".join(log.read_text().splitlines()[-40:])
        wall = time.perf_counter() - start
        run = LaunchRun(code, round(wall, 2), output, command_started=run_started)
        found = list(Path(scratch).glob("outputs/**/results.json"))
        if found:
            run.results = json.loads(found[0].read_text())
        rows = list(Path(scratch).glob("outputs/**/metrics.jsonl"))
        if rows:
            run.metrics = [json.loads(line) for line in rows[0].read_text().splitlines() if line.strip()]
    return run
