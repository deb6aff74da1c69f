"""`launch -m`: one sweep run (SweepJob), the sweep's summary, and how runs report back to Hydra.

Hydra expands the sweep and composes every run's config; launch's own Hydra launcher
(launcher/host/sweep_launcher.py, selected by conf/config.yaml as `hydra/launcher=launch`) then hands
the runs to their backend: backend=local runs them side by side on free GPUs (launcher/host/packing.py),
backend=slurm submits job arrays (launcher/host/backends/slurm.py). Each run returns its
`sweep.objective` (test_acc by default) to Hydra, so a sweeper such as Optuna can optimize it.

After the sweep: `summary.csv` and `summary.md` in the sweep dir (one row per run: its overrides,
final metrics, img/s, time, exit code), the Markdown table printed, and `summary.png`: the swept
key against throughput and the objective (test accuracy, or the recipe's own figure).
"""

from __future__ import annotations

import csv
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from launcher.config import Config, minimized
from launcher.files import METRICS, RESULTS, read_json, read_json_lines
from launcher.host.outcome import RunFailed, effective_objective, objective_of


@dataclass
class SweepJob:
    num: int
    overrides: list[str]
    config: Any  # the run's composed DictConfig, Hydra's part included (what hydra's run_job takes)
    cfg: Config  # the same, typed, frozen and checked
    run_dir: Path
    # set as it runs
    gpus: list[int] = field(default_factory=list)
    started: bool = False
    seconds: float = 0.0
    exit_code: int | None = None  # None: submitted, not followed (backend.wait=false)
    error: str | None = None  # a failed run's one-line reason
    results: dict[str, Any] = field(default_factory=dict)  # its results.json, read once it has ended
    logged: dict[str, Any] = field(default_factory=dict)  # without one (stopped, failed): its epochs' (`_logged`)

    def finished(self, exit_code: int, error: str | None = None, seconds: float | None = None) -> None:
        self.exit_code = exit_code
        self.error = error
        if seconds is not None:
            self.seconds = seconds
        self.results = read_json(self.run_dir / RESULTS)
        self.logged = {} if self.results else _logged(self.run_dir)

    @property
    def objective(self) -> float | None:
        """The run's `sweep.objective` value, for the sweeper."""
        return objective_of(self.results, self.cfg.sweep.objective)

    def job_return(self):
        """What Hydra's sweeper gets back: the objective, or a RunFailed it re-raises."""
        from hydra.core.utils import JobReturn, JobStatus

        failed = self.exit_code not in (None, 0)
        ret = JobReturn(overrides=self.overrides, hydra_cfg=self.config, working_dir=str(self.run_dir),
                        task_name=str(self.config.hydra.job.name),
                        status=JobStatus.FAILED if failed else JobStatus.COMPLETED)
        ret.return_value = RunFailed(self.exit_code or 1, self.error or "failed") if failed else self.objective
        return ret


# ---- the summary -----------------------------------------------------------------------------------

COLUMNS = ("job", "overrides", "exit_code", "test_acc", "best_test_acc", "loss", "img_per_s", "tokens_per_s",
           "samples_per_s", "epochs", "seconds", "run_dir")


def summary_row(job: SweepJob) -> dict[str, Any]:
    """The job's row. `seconds`: the run's wall time here, or (a SLURM run, timed elsewhere) its worker
    time from results.json; none for a run not followed to its end."""
    results = job.results
    shown = results or job.logged  # (a run stopped before its results.json: the epochs it logged)
    final = shown.get("final") or {}
    seconds = job.seconds or results.get("worker_s") or 0.0
    return {"job": job.num, "overrides": " ".join(job.overrides), "exit_code": job.exit_code,
            "test_acc": shown.get("test_acc"), "best_test_acc": shown.get("best_test_acc"),
            "loss": final.get("loss"),
            "img_per_s": final.get("img_per_s", final.get("images_per_s")),  # (images: recipe=imagefolder's)
            "tokens_per_s": final.get("tokens_per_s"), "epochs": final.get("epoch"),
            # (a run that never started, a Ctrl-C first, has neither: its folder was never made)
            "seconds": round(seconds, 1) if job.exit_code is not None else None,
            "run_dir": str(job.run_dir) if job.run_dir.exists() else None,
            "samples_per_s": final.get("samples_per_s"),
            "objective": effective_objective(results, job.cfg.sweep.objective),
            "objective_value": objective_of(results, job.cfg.sweep.objective)}


def _logged(run_dir: Path) -> dict[str, Any]:
    """What a run that ended without its results.json (stopped by Ctrl-C, failed) logged, for its row of the
    summary: its last epoch's figures as `final`, its last and best test accuracy; {} where it logged no
    epoch. Shown only: the sweep's objective and best line take finished runs' results alone."""
    rows = read_json_lines(run_dir / METRICS)
    if not rows:
        return {}
    accs = [r["test_acc"] for r in rows if isinstance(r.get("test_acc"), (int, float))]
    return {"final": rows[-1], "test_acc": rows[-1].get("test_acc"), "best_test_acc": max(accs) if accs else None}


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
    objective = rows[0]["objective"] if rows else "test_acc"
    if objective != "test_acc":  # (a recipe's own figure: its column, by name)
        for row in rows:
            row[objective] = row["objective_value"]
    with open(sweep_dir / "summary.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[*COLUMNS, *([objective] if objective != "test_acc" else [])],
                               extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    rate = throughput_key(rows)
    # (the table shows what each run was given that the others were not: the shared overrides, repeated on
    # every row, buried the swept values; summary.csv keeps them all)
    varied = swept_keys(jobs) if len(jobs) > 1 else []
    ordered = sorted(jobs, key=lambda j: j.num)
    for row, job in zip(rows, ordered, strict=True):
        row["swept"] = " ".join(o for o in job.overrides if o.partition("=")[0] in varied) or row["overrides"]
    given = "swept" if varied else "overrides"
    shown = ("job", given, "exit_code", "test_acc" if objective == "test_acc" else objective, "loss", rate,
             "seconds")
    lines = ["| " + " | ".join(shown) + " |", "|" + "---|" * len(shown)]
    for row in rows:
        lines.append("| " + " | ".join(_cell(k, row.get(k)) for k in shown) + " |")
    scored = [r for r in rows if isinstance(r["objective_value"], (int, float))]
    if scored and len(rows) > 1:  # (the objective's better way: accuracy up, an error down, as sweep.direction
        # says; among the runs that have the figure: one failed run of two left the other's best line out)
        pick = min if minimized(objective, getattr(jobs[0].cfg.sweep, "direction", "auto")) else max
        best = pick(scored, key=lambda r: r["objective_value"])
        value = best["objective_value"]
        value = _cell("test_acc", value) if objective == "test_acc" else f"{value:.4g}"
        where = f": {best['run_dir']}" if best.get("run_dir") else ""
        lines.append(f"\nbest: job {best['job']} ({best[given]}), {objective} {value}{where}")
    table = "\n".join(lines) + "\n"
    (sweep_dir / "summary.md").write_text(table)
    _plot(rows, swept_keys(jobs), sweep_dir / "summary.png", rate, objective)
    return table


def report(jobs: list[SweepJob], sweep_dir: Path) -> None:
    """Write the summary files and print the table and where they are (local and SLURM sweeps alike)."""
    table = write_summary(jobs, sweep_dir)
    print(f"\nsweep: {len(jobs)} runs\n{table}\nsweep summary: {sweep_dir / 'summary.md'} · "
          f"{sweep_dir / 'summary.csv'} · {sweep_dir / 'summary.png'}", flush=True)


def throughput_key(rows: list[dict[str, Any]]) -> str:
    """img_per_s, or tokens_per_s for sweeps of language models."""
    tokens = any(r.get("tokens_per_s") for r in rows) and not any(r.get("img_per_s") for r in rows)
    samples = any(r.get("samples_per_s") for r in rows) and not any(r.get("img_per_s") for r in rows)
    return "tokens_per_s" if tokens else "samples_per_s" if samples else "img_per_s"


def _cell(key: str, value: Any) -> str:
    if value is None:
        return "-"
    if key == "test_acc":
        return f"{100 * value:.2f}%"
    if key in ("img_per_s", "tokens_per_s", "samples_per_s"):
        return f"{value:,.0f}"
    if key == "loss" or (key.startswith("test_") and isinstance(value, float)):
        return f"{value:.4f}"
    return str(value).replace("|", "\\|")


def _plot(rows: list[dict[str, Any]], keys: list[str], path: Path, rate: str = "img_per_s",
          objective: str = "test_acc") -> None:
    """The swept key against throughput and the objective (the test accuracy, or a recipe's own figure)."""
    from matplotlib.figure import Figure  # (not pyplot: no process-wide figure registry, no backend to pick)

    def label(row: dict[str, Any]) -> str:
        pairs = dict(o.partition("=")[::2] for o in row["overrides"].split())
        return ", ".join(f"{k}={pairs.get(k, '')}" for k in keys) if keys else f"job {row['job']}"

    x_values = [label(r) for r in rows]
    numeric = len(keys) == 1 and all(_number(x.split("=", 1)[1]) is not None for x in x_values)
    xs = [_number(x.split("=", 1)[1]) for x in x_values] if numeric else list(range(len(rows)))
    fig = Figure(figsize=(10, 4))
    ax1, ax2 = fig.subplots(1, 2)
    unit = {"tokens_per_s": "tokens/s", "samples_per_s": "samples/s"}.get(rate, "img/s")
    scored = ("test_acc", "test accuracy") if objective == "test_acc" else ("objective_value", objective)
    for ax, key, title in ((ax1, rate, f"throughput ({unit})"), (ax2, *scored)):
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


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None



def run_sweep_job(hydra_context: Any, task_function: Any, config: Any):
    """Hydra's run_job for one sweep run: its dir under the sweep dir, its .hydra/ files, callbacks."""
    from hydra.core.utils import run_job

    return run_job(hydra_context=hydra_context, task_function=task_function, config=config,
                   job_dir_key="hydra.sweep.dir", job_subdir_key="hydra.sweep.subdir")


@dataclass(frozen=True)
class SweepContext:
    """What a backend needs to run a batch of sweep runs: Hydra's context and task function (a run is
    Hydra's run_job of them), and the sweep dir."""

    hydra_context: Any
    task_function: Any
    sweep_dir: Path


def save_hydra_files(job: SweepJob) -> None:
    """The run's `.hydra/` files, as Hydra's run_job writes them, for runs that run_job does not start
    here (a SLURM job array's elements)."""
    from omegaconf import OmegaConf

    subdir = job.config.hydra.output_subdir
    if subdir is None:
        return
    folder = job.run_dir / str(subdir)
    folder.mkdir(parents=True, exist_ok=True)
    task = {k: v for k, v in job.config.items() if k != "hydra"}
    OmegaConf.save(OmegaConf.create(task), folder / "config.yaml")
    OmegaConf.save(OmegaConf.create({"hydra": job.config.hydra}), folder / "hydra.yaml")
    OmegaConf.save(job.config.hydra.overrides.task, folder / "overrides.yaml")
