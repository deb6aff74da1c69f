"""`launch -m ...` on this host: the sweep's runs side by side, each on GPUs of its own, then a summary.

Hydra's own launcher runs a sweep's jobs one after another, and submitit's local executor hands
every job the same first GPUs. Here Hydra still expands the sweep and makes each job's directory,
but each job runs as a child `launch` with `gpus=[...]` set to GPUs no other running job holds: on
a 2-GPU host two 1-GPU runs train at once. A job that asks for more GPUs than are free waits for
them; `gpus=auto`/`all` means every visible GPU (so those jobs run one at a time); CPU jobs run one
at a time unless `sweep.parallel` allows more. Each child's output goes to `launch.out` in its run
dir; one line per job start and end is printed here.

After the sweep: `summary.csv` and `summary.md` in the sweep dir (one row per run: its overrides,
final metrics, img/s, time, exit code), the Markdown table printed, and `summary.png`: the swept
key against throughput and test accuracy.
"""

from __future__ import annotations

import csv
import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# ---- which GPUs a job needs (pure: unit-tested with made-up inventories) ---------------------------


@dataclass(frozen=True)
class GpuRequest:
    count: int  # GPUs the job needs (0: CPU)
    ids: tuple[int, ...] | None = None  # exactly these (the user named them), else any `count` free ones


def gpu_request(gpus: Any, strategy: str, visible: int) -> GpuRequest:
    """What a job's `gpus` asks of a host with `visible` GPUs (mirrors the plan's own reading)."""
    if isinstance(gpus, str):
        if gpus == "auto":
            if visible == 0:
                return GpuRequest(0)
            return GpuRequest(1 if strategy == "single" else visible)
        if gpus == "all":
            return GpuRequest(visible)
        return GpuRequest(min(1, visible))  # anything else: the child reports the error itself
    if isinstance(gpus, int) and not isinstance(gpus, bool):
        return GpuRequest(gpus)
    ids = tuple(int(i) for i in gpus)
    return GpuRequest(len(ids), ids) if ids else GpuRequest(0)


class GpuPool:
    """Which visible GPUs (by the index users type) are held by running jobs."""

    def __init__(self, visible: int, cpu_slots: int = 1):
        self.free = list(range(visible))
        self.visible = visible
        self.cpu_slots = cpu_slots
        self.cpu_running = 0

    def take(self, request: GpuRequest) -> list[int] | None:
        """GPU ids for the job, or None if it must wait. A request larger than the host is let through
        alone (with every GPU), so that the job itself reports the problem instead of waiting forever."""
        if request.count == 0:
            if self.cpu_running >= self.cpu_slots:
                return None
            self.cpu_running += 1
            return []
        if request.ids is not None:
            wanted = [i for i in request.ids if i < self.visible]
            if all(i in self.free for i in wanted):
                self.free = [i for i in self.free if i not in wanted]
                return list(request.ids)
            return None
        need = min(request.count, self.visible)
        if len(self.free) < need or (need < request.count and len(self.free) < self.visible):
            return None
        taken, self.free = self.free[:need], self.free[need:]
        return taken

    def give_back(self, ids: list[int]) -> None:
        if not ids:
            self.cpu_running -= 1
            return
        self.free = sorted(set(self.free) | {i for i in ids if i < self.visible})


# ---- running the jobs ------------------------------------------------------------------------------


@dataclass
class SweepJob:
    num: int
    overrides: list[str]
    run_dir: Path
    request: GpuRequest = GpuRequest(0)  # (a SLURM sweep's runs ask SLURM, not this pool)
    gpus: list[int] = field(default_factory=list)
    process: subprocess.Popen | None = None
    started: float = 0.0
    seconds: float = 0.0
    exit_code: int | None = None
    row: dict[str, Any] | None = None  # its summary row, read from its run dir once it has ended


def _die_with_parent() -> None:
    """Child preexec: SIGTERM when the sweep's launcher dies, even by SIGKILL (Linux prctl)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def child_overrides(job: SweepJob) -> list[str]:
    gpus = "[" + ",".join(map(str, job.gpus)) + "]"
    kept = [o for o in job.overrides if not o.lstrip("+~").startswith(("gpus=", "hydra.run.dir=", "sweep."))]
    return [*kept, f"gpus={gpus}", f"hydra.run.dir={job.run_dir}"]


class LocalSweep:
    def __init__(self, visible: int, parallel: int = 0):
        # parallel: most jobs at once (0: as many as the GPUs allow, CPU jobs one at a time)
        self.pool = GpuPool(visible, cpu_slots=max(1, parallel))
        self.limit = parallel if parallel > 0 else None
        self.jobs: list[SweepJob] = []
        self.running: list[SweepJob] = []

    def submit(self, job: SweepJob) -> None:
        """Start the job as soon as what it needs is free (returns once it has started)."""
        while True:
            if self.limit is None or len(self.running) < self.limit:
                taken = self.pool.take(job.request)
                if taken is not None:
                    break
            self._wait_for_one()
        job.gpus = taken
        job.run_dir.mkdir(parents=True, exist_ok=True)
        out = open(job.run_dir / "launch.out", "w")  # noqa: SIM115 - closed when the job is reaped
        job.started = time.monotonic()
        job.process = subprocess.Popen([sys.executable, "-m", "launcher.cli", *child_overrides(job)],
                                       stdout=out, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent,
                                       env=self._child_env(job))
        out.close()  # the child holds its own copy
        self.jobs.append(job)
        self.running.append(job)
        where = f"GPU{'s' if len(job.gpus) > 1 else ''} {job.gpus}" if job.gpus else "CPU"
        print(f"sweep: job {job.num} started on {where}: {' '.join(job.overrides) or '(defaults)'}", flush=True)

    def _child_env(self, job: SweepJob) -> dict[str, str]:
        """CPU runs side by side split the cores between them (each would otherwise size its threads
        to the whole machine and they would crawl); the user's OMP_NUM_THREADS wins."""
        env = dict(os.environ)
        if not job.request.count and self.pool.cpu_slots > 1 and "OMP_NUM_THREADS" not in env:
            from launcher.plan import available_cores

            env["OMP_NUM_THREADS"] = str(max(1, available_cores(env) // self.pool.cpu_slots))
        return env

    def _wait_for_one(self) -> None:
        """Until a running job ends (something runs whenever a job waits: with all free it would fit)."""
        while True:
            for job in list(self.running):
                code = job.process.poll()
                if code is not None:
                    self._finished(job, code)
                    return
            time.sleep(0.2)

    def _finished(self, job: SweepJob, code: int) -> None:
        job.exit_code = code
        job.seconds = time.monotonic() - job.started
        self.running.remove(job)
        self.pool.give_back(job.gpus)
        if code != 0:  # the child's own one-line reason (its last "launch: ..." line), on stderr
            print(f"sweep: job {job.num} FAILED (exit {code}) in {job.seconds:.1f}s: {_reason(job)}",
                  file=sys.stderr, flush=True)
            return
        row = summary_row(job)
        result = f"test acc {100 * row['test_acc']:.2f}%" if isinstance(row.get("test_acc"), float) else "no test"
        if row.get("img_per_s"):
            result += f", {row['img_per_s']:,.0f} img/s"
        print(f"sweep: job {job.num} done in {job.seconds:.1f}s: {result}", flush=True)

    def wait_all(self) -> list[SweepJob]:
        try:
            while self.running:
                self._wait_for_one()
        except BaseException:
            self.stop()
            raise
        return self.jobs

    def stop(self) -> None:
        for job in self.running:
            if job.process.poll() is None:
                job.process.send_signal(signal.SIGTERM)
        for job in self.running:
            try:
                job.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                job.process.kill()


def _reason(job: SweepJob) -> str:
    out = job.run_dir / "launch.out"
    lines = out.read_text(errors="replace").splitlines() if out.exists() else []
    said = [line[len("launch: "):] for line in lines if line.startswith("launch: ")]
    return (said[-1] if said else (lines[-1] if lines else "no output")) + f" (output: {out})"


# ---- the summary -----------------------------------------------------------------------------------

COLUMNS = ("job", "overrides", "exit_code", "test_acc", "best_test_acc", "loss", "img_per_s", "epochs", "seconds",
           "run_dir")


def summary_row(job: SweepJob) -> dict[str, Any]:
    """The job's row, from its results.json (read once). `seconds`: the run's wall time here, or (a
    SLURM run, timed elsewhere) its worker time from results.json."""
    if job.row is None:
        results_path = job.run_dir / "results.json"
        results = json.loads(results_path.read_text()) if results_path.exists() else {}
        final = results.get("final") or {}
        seconds = job.seconds or results.get("worker_s") or 0.0
        job.row = {"job": job.num, "overrides": " ".join(job.overrides), "exit_code": job.exit_code,
                   "test_acc": results.get("test_acc"), "best_test_acc": results.get("best_test_acc"),
                   "loss": final.get("loss"), "img_per_s": final.get("img_per_s"), "epochs": final.get("epoch"),
                   "seconds": round(seconds, 1), "run_dir": str(job.run_dir)}
    return job.row


def swept_keys(jobs: list[SweepJob]) -> list[str]:
    """Keys whose value differs between the jobs, in the order they were typed."""
    values: dict[str, set[str]] = {}
    for job in jobs:
        for override in job.overrides:
            key, _, value = override.partition("=")
            values.setdefault(key, set()).add(value)
    return [k for k, v in values.items() if len(v) > 1]


def write_summary(jobs: list[SweepJob], sweep_dir: Path) -> str:
    """summary.csv, summary.md and summary.png in the sweep dir; returns the Markdown table."""
    sweep_dir.mkdir(parents=True, exist_ok=True)
    rows = [summary_row(j) for j in sorted(jobs, key=lambda j: j.num)]
    with open(sweep_dir / "summary.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    shown = ("job", "overrides", "exit_code", "test_acc", "loss", "img_per_s", "seconds")
    lines = ["| " + " | ".join(shown) + " |", "|" + "---|" * len(shown)]
    for row in rows:
        lines.append("| " + " | ".join(_cell(k, row[k]) for k in shown) + " |")
    table = "\n".join(lines) + "\n"
    (sweep_dir / "summary.md").write_text(table)
    _plot(rows, swept_keys(jobs), sweep_dir / "summary.png")
    return table


def report(jobs: list[SweepJob], sweep_dir: Path) -> None:
    """Write the summary files and print the table and where they are (local and SLURM sweeps alike)."""
    table = write_summary(jobs, sweep_dir)
    print(f"\nsweep: {len(jobs)} runs\n{table}\nsweep summary: {sweep_dir / 'summary.md'} · "
          f"{sweep_dir / 'summary.csv'} · {sweep_dir / 'summary.png'}", flush=True)


def _cell(key: str, value: Any) -> str:
    if value is None:
        return "-"
    if key == "test_acc":
        return f"{100 * value:.2f}%"
    if key == "img_per_s":
        return f"{value:,.0f}"
    if key == "loss":
        return f"{value:.4f}"
    return str(value).replace("|", "\\|")


def _plot(rows: list[dict[str, Any]], keys: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def label(row: dict[str, Any]) -> str:
        pairs = dict(o.partition("=")[::2] for o in row["overrides"].split())
        return ", ".join(f"{k}={pairs.get(k, '')}" for k in keys) if keys else f"job {row['job']}"

    x_values = [label(r) for r in rows]
    numeric = len(keys) == 1 and all(_number(x.split("=", 1)[1]) is not None for x in x_values)
    xs = [_number(x.split("=", 1)[1]) for x in x_values] if numeric else list(range(len(rows)))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, title in ((ax1, "img_per_s", "throughput (img/s)"), (ax2, "test_acc", "test accuracy")):
        ys = [r[key] if isinstance(r[key], (int, float)) else float("nan") for r in rows]
        ax.plot(xs, ys, "o-")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        if numeric:
            ax.set_xlabel(keys[0])
            if min(xs) > 0 and max(xs) / min(xs) >= 8:
                ax.set_xscale("log", base=2)
        else:
            ax.set_xticks(xs, x_values, rotation=30, ha="right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None

