"""`launch runs [--json] [--limit N]`: the recent runs under outputs/ and multirun/ of this directory,
newest first: when, recipe, strategy, devices, epochs, what a sweep's run was given that its sweep's other
runs were not (`lr=0.2`), the best of the figure it was judged by (its sweep.objective: recipe=text's
held-out loss) or its best test accuracy, state, dir.

A run's state, from what its dir holds (launcher/files.py names the files):
    running    its claim's process is alive (on this host)
    finished   results.json (or eval.json for `launch eval`), or a script's launch that ended with exit 0
    stopped early (FIGURE)   finished before its last epoch: early_stop saw FIGURE stop improving
    preempted  SLURM asked it to stop and requeue (`preempted`), not finished since
    stopped    its launch was stopped by a signal (Ctrl-C, SIGTERM, ...): `stopped (SIGINT)`
    failed     anything else that started (a failure record, a launch that ended with an error, or
               one killed outright, which records nothing)
The launch's own record of how it ended is outcome.json (exit code, signal, its one-line error).
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback

from launcher.files import (
    CLAIM,
    CONFIG,
    EVAL,
    FAILURES,
    METRICS,
    OUTCOME,
    PLAN,
    PREEMPTED,
    RESULTS,
    SWEEP_MARK,
    read_json,
    read_json_lines,
)
from launcher.host.resume import latest
from launcher.host.rundir import pid_alive, read_claim

ROOTS = ("outputs", "multirun")
USAGE = "launch runs [--json] [--limit N]"


def _config_values(run_dir: Path) -> dict[str, Any]:
    """recipe, model and epochs from config.yaml (plain YAML; no Hydra needed to read it), as written: a
    `${...}` in it is text (launch writes configs resolved), never resolved here (`${oc.env:...}`)."""
    try:
        from omegaconf import OmegaConf

        if not (run_dir / CONFIG).is_file():  # (a FIFO would block)
            return {}
        cfg = OmegaConf.to_container(OmegaConf.load(run_dir / CONFIG), resolve=False)
        recipe = cfg.get("recipe") if isinstance(cfg.get("recipe"), dict) else {}
        sweep = cfg.get("sweep") if isinstance(cfg.get("sweep"), dict) else {}
        return {"recipe": recipe.get("name"), "model": recipe.get("model"), "epochs": cfg.get("epochs"),
                "script": cfg.get("script"), "objective": sweep.get("objective")}
    except Exception:  # noqa: BLE001 - a torn or missing config.yaml: show what else is known
        return {}


def describe(run_dir: Path) -> dict[str, Any]:
    claim = read_claim(run_dir) or {}
    plan = read_json(run_dir / PLAN)
    results = read_json(run_dir / RESULTS) or read_json(run_dir / EVAL)
    ended = read_json(run_dir / OUTCOME)
    values = _config_values(run_dir)
    rows = read_json_lines(run_dir / METRICS)
    accs = [r["test_acc"] for r in rows if isinstance(r.get("test_acc"), (int, float))]
    best = results.get("best_test_acc") or results.get("test_acc") or (max(accs) if accs else None)
    # a recipe's own figure where it has no accuracy: its sweep.objective's best (minimized where an error)
    objective = results.get("objective") if isinstance(results.get("objective"), str) else None
    figure = results.get(f"best_{objective}") if objective and objective != "test_acc" else None
    if figure is None and values.get("objective") not in (None, "test_acc"):
        objective = str(values["objective"])  # (recipe=text's held-out loss, as the run is judged)
        if (run_dir / EVAL).exists():  # (`launch eval`: eval.json names no objective; its config does)
            figure = results.get(objective)
        elif not results:  # (stopped or failed before its results: the epochs it logged)
            from launcher.config import minimized

            seen = [r[objective] for r in rows if isinstance(r.get(objective), (int, float))]
            figure = (min if minimized(objective) else max)(seen) if seen else None
    best_figure = {"name": objective, "value": figure} if isinstance(figure, (int, float)) else None
    if best_figure and objective == "test_loss":  # (recipe=text: in nats; its epoch lines say bpb or perplexity)
        said = {k for r in rows for k in r} | set(results) | set(results.get("final") or {})
        best_figure["per"] = "bpb" if "test_bpb" in said else "ppl" if "test_ppl" in said else None
    if claim and pid_alive(claim.get("pid"), claim.get("host")):
        state = "running"
    elif (results and ended.get("exit_code") in (None, 0)) or ended.get("exit_code") == 0:  # (not: failed to record)
        stopped = results.get("stopped_early")
        state = f"stopped early ({stopped.get('metric')})" if isinstance(stopped, dict) else "finished"
    elif (run_dir / PREEMPTED).exists():
        state = "preempted"
    elif ended.get("stopped_by"):
        state = f"stopped ({ended['stopped_by']})"
    else:
        state = "failed"
    started = claim.get("started")
    if not started:
        source = run_dir / PLAN if (run_dir / PLAN).exists() else run_dir
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(source.stat().st_mtime))
    devices = plan.get("gpu_ids")
    what = values.get("script") or values.get("recipe") or results.get("recipe")
    if what and values.get("script"):
        what = Path(str(what)).name
    if what and (run_dir / EVAL).exists():
        what = f"{what} (eval)"
    return {
        "started": started,
        "recipe": what,
        "strategy": plan.get("strategy"),
        "devices": (f"GPU {','.join(map(str, devices))}" if devices else
                    f"CPU x{plan.get('nprocs', 1)}" if plan else None),
        "epochs": f"{len(rows)}/{values.get('epochs')}" if values.get("epochs") and not (run_dir / EVAL).exists()
        and not values.get("script") else None,  # (a script's epochs are its own business)
        "best_test_acc": best,
        "best_figure": best_figure,
        "state": state,
        "failed_ranks": sorted({p.name for p in (run_dir / FAILURES).glob("*.json")}) if state == "failed" else [],
        "exit_code": ended.get("exit_code"),
        "error": ended.get("error"),
        "dir": str(run_dir),
    }


def unreadable(run_dir: Path, exc: Exception) -> dict[str, Any]:
    """The row of a run whose files cannot be read as launch wrote them (edited by hand, damaged)."""
    try:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(run_dir.stat().st_mtime))
    except OSError:
        started = "?"
    why = f"{type(exc).__name__}: {exc}".splitlines()[0][:120]
    return {"started": started, "recipe": None, "strategy": None, "devices": None, "epochs": None,
            "best_test_acc": None, "best_figure": None, "state": "unreadable", "failed_ranks": [],
            "exit_code": None, "error": why, "dir": str(run_dir)}


def describe_or_say(run_dir: Path) -> dict[str, Any]:
    """`describe`, or an `unreadable` row: one bad run never stops the listing."""
    try:
        return describe(run_dir)
    except Exception as exc:  # noqa: BLE001 - any file of the run may be anything
        return unreadable(run_dir, exc)


def printable(value: Any) -> str:
    """A cell as text with control characters (terminal escape sequences in a name) shown escaped."""
    text = str(value)
    return text if text.isprintable() else "".join(c if c.isprintable() else c.encode("unicode_escape").decode()
                                                   for c in text)


def find(root: Path) -> list[Path]:
    """Run dirs under outputs/ and multirun/ (a dir launch claimed or wrote a plan into)."""
    found = set()
    for top in ROOTS:
        base = root / top
        if not base.is_dir():
            continue
        for marker in (CLAIM, PLAN):
            for path in base.glob(f"**/{marker}"):
                if not _sweep_dir(path.parent):  # (its runs are listed, not it)
                    found.add(path.parent)
    return sorted(found)


def _sweep_dir(folder: Path) -> bool:
    """A sweep's own dir: Hydra's basic sweeper writes multirun.yaml there, launch's sweep launcher its mark,
    and launch's claim says so. An Optuna sweep has no multirun.yaml, and was listed as a failed run."""
    return ((folder / "multirun.yaml").exists() or (folder / SWEEP_MARK).exists()
            or read_json(folder / CLAIM).get("setting") == "hydra.sweep.dir")


def _overrides(run_dir: Path) -> dict[str, str]:
    """The run's command-line overrides as Hydra recorded them (.hydra/overrides.yaml), key -> value."""
    try:
        from omegaconf import OmegaConf

        path = run_dir / ".hydra" / "overrides.yaml"
        listed = OmegaConf.to_container(OmegaConf.load(path)) if path.is_file() else []
    except Exception:  # noqa: BLE001 - torn or hand-edited: nothing shown
        return {}
    pairs = (str(o).partition("=") for o in listed if isinstance(o, str) and "=" in o) if isinstance(listed, list) \
        else ()
    return {key.lstrip("+~"): value for key, _, value in pairs}


def add_swept(runs: list[dict[str, Any]]) -> None:
    """Each run of a sweep gets `swept`: its overrides whose values differ among its sweep's runs (all of
    them, listed or not), e.g. {"lr": "0.2"}: the rows of a sweep said nothing of which run was which."""
    sweeps: dict[Path, dict[Path, dict[str, str]]] = {}
    for run in runs:
        folder = Path(run["dir"])
        if folder.parent not in sweeps:
            siblings = [d for d in folder.parent.iterdir() if (d / ".hydra" / "overrides.yaml").is_file()] \
                if _sweep_dir(folder.parent) else []
            sweeps[folder.parent] = {d: _overrides(d) for d in siblings}
        jobs = sweeps[folder.parent]
        if folder not in jobs or len(jobs) < 2:
            continue
        keys = {k for given in jobs.values() for k in given}
        varied = [k for k in keys if len({given.get(k) for given in jobs.values()}) > 1]
        order = list(jobs[folder])  # (as typed)
        run["swept"] = {k: jobs[folder].get(k, "-") for k in sorted(varied, key=lambda k: (
            order.index(k) if k in order else len(order), k))}


def _swept(run: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in (run.get("swept") or {}).items()) or "-"


def _best(run: dict[str, Any]) -> str:
    """The best of the figure the run was judged by (sweep.objective: test_loss 2.029, test_rmse 0.4354),
    else its best accuracy."""
    figure = run.get("best_figure")
    if figure and figure.get("per") == "bpb":  # (a loss in nats per byte, as bits per byte too)
        return f"{figure['name']} {figure['value']:.4g} ({figure['value'] / math.log(2):.3f} bpb)"
    if figure and figure.get("per") == "ppl":
        return f"{figure['name']} {figure['value']:.4g} (ppl {math.exp(min(figure['value'], 700.0)):.4g})"
    if figure:
        return f"{figure['name']} {figure['value']:.4g}"
    if isinstance(run.get("best_test_acc"), (int, float)):
        return f"{100 * run['best_test_acc']:.2f}%"
    return "-"


# Columns left out, in this order, while the table is wider than the terminal; then the dir is cut from the left.
DROPPED_FIRST = ("strategy", "devices", "started", "epochs", "swept", "recipe")


def table(runs: list[dict[str, Any]], columns: int | None = None) -> str:
    """The runs as aligned columns, fitting `columns` characters where it can: COLUMNS, else the terminal's
    width when printing to one (piped to another program, the rows are whole)."""
    import os
    import shutil

    if columns is None and (os.environ.get("COLUMNS", "").isdigit() or sys.stdout.isatty()):
        columns = shutil.get_terminal_size((120, 24)).columns
    columns = columns or 1 << 30
    heads = ["started", "recipe", "strategy", "devices", "epochs", "swept", "best", "state", "dir"]
    cells = [[printable(x) for x in (r["started"], r["recipe"] or "-", r["strategy"] or "-", r["devices"] or "-",
                                     r["epochs"] or "-", _swept(r), _best(r), r["state"], r["dir"])] for r in runs]

    def width(heads: list[str], cells: list[list[str]]) -> list[int]:
        return [max(len(x) for x in col) for col in zip(heads, *cells, strict=False)]

    def fits() -> bool:
        return sum(width(heads, cells)) + 2 * (len(heads) - 1) <= columns

    def drop(name: str) -> None:
        at = heads.index(name)
        heads.pop(at)
        for row in cells:
            row.pop(at)

    def cut_dir() -> None:  # the dir's tail, which names the run
        keep = max(columns - (sum(width(heads, cells)[:-1]) + 2 * (len(heads) - 1)), 16)
        for row in cells:
            row[-1] = row[-1] if len(row[-1]) <= keep else "..." + row[-1][-(keep - 3):]

    if not any(r.get("swept") for r in runs):  # (no sweep among them: no column of dashes)
        drop("swept")
    for name in DROPPED_FIRST:
        if name not in heads:
            continue
        if fits():
            break
        if name == "recipe":  # (before the recipe goes, the dir is shortened)
            cut_dir()
            if fits():
                break
        drop(name)
    if not fits():
        cut_dir()
    widths = width(heads, cells)
    lines = ["  ".join(x.ljust(w) for x, w in zip(row, widths, strict=True)).rstrip() for row in (heads, *cells)]
    return "\n".join(lines)


def sweep_table(sweep_dir: Path) -> str:
    """A sweep's runs (its dir's numbered run dirs, in order) as `launch runs` shows them, with one line
    above that counts them by state: what `launch -m` prints when another Hydra launcher ran them."""
    dirs = sorted((d for d in sweep_dir.iterdir() if d.is_dir() and d.name.isdigit()), key=lambda d: int(d.name)) \
        if sweep_dir.is_dir() else []
    runs = [describe_or_say(d) for d in dirs]
    if not runs:
        return f"no runs in {printable(sweep_dir)}"
    add_swept(runs)
    states: dict[str, int] = {}
    for run in runs:
        states[run["state"]] = states.get(run["state"], 0) + 1
        run["dir"] = Path(run["dir"]).name  # (the sweep dir is named above: each run by its number)
    counted = ", ".join(f"{n} {state}" for state, n in states.items())
    return f"{len(runs)} run{'s' if len(runs) != 1 else ''} in {printable(sweep_dir)}: {counted}\n{table(runs)}"


def _launcher_choice(config: Any) -> str:
    """The hydra/launcher option a sweep runs under, as typed (submitit_slurm), else its class."""
    from omegaconf import OmegaConf

    choices = OmegaConf.select(config, "hydra.runtime.choices") or {}
    return str(choices.get("hydra/launcher") or OmegaConf.select(config, "hydra.launcher._target_"))


class SweepTable(Callback):
    """The Hydra callback (conf/config.yaml: hydra.callbacks) that, under another Hydra launcher than
    launch's own (which prints its summary), says where submitit's runs print as they start, and prints the
    runs' table when they have ended: their own lines went to their processes' logs (submitit) or
    scrolled past, and the console stayed blank to the end."""

    @staticmethod
    def _other(config: Any) -> str | None:
        from omegaconf import OmegaConf

        from launcher.host.compose import SWEEP_LAUNCHER

        target = str(OmegaConf.select(config, "hydra.launcher._target_"))
        return None if target == SWEEP_LAUNCHER else target

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        from omegaconf import OmegaConf

        if ".submitit_launcher." in (self._other(config) or ""):
            print(f"launch: the sweep's runs are started by hydra/launcher={_launcher_choice(config)}; each run "
                  f"prints into {OmegaConf.select(config, 'hydra.sweep.dir')}/.submitit/JOB/, and the runs' table "
                  "follows here when they have ended", flush=True)

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        from omegaconf import OmegaConf

        if self._other(config):
            sweep_dir = Path(str(OmegaConf.select(config, "hydra.sweep.dir")))
            print(f"launch: under hydra/launcher={_launcher_choice(config)}, {sweep_table(sweep_dir)}", flush=True)


def main(argv: list[str], root: Path | None = None) -> int:
    as_json, limit = False, 20
    args = list(argv)
    while args:
        arg = args.pop(0)
        if arg == "--json":
            as_json = True
        elif arg in ("--limit", "-n") and args and args[0].isdigit():
            limit = int(args.pop(0))
        elif arg == "--all":
            limit = 0
        else:
            print(f"launch: runs does not take {arg!r}: {USAGE}", file=sys.stderr)
            return 2
    root = Path.cwd() if root is None else root
    runs = sorted((describe_or_say(d) for d in find(root)), key=lambda r: (str(r["started"]), r["dir"]),
                  reverse=True)
    runs = runs[:limit] if limit else runs
    add_swept(runs)
    # The run `resume=latest` continues: the checkpoint written last, which need not be the run started last.
    newest = latest(root / "outputs")
    for run in runs:
        run["resume_latest"] = newest is not None and Path(run["dir"]) == newest.parent.parent
    if as_json:
        print(json.dumps(runs, indent=2))
    elif not runs:
        print(f"no runs under {root / 'outputs'} or {root / 'multirun'}")
    else:
        print(table(runs))
        try:
            written = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(newest.stat().st_mtime)) if newest else None
        except OSError:  # (replaced this instant)
            written = "just now"
        if newest is not None:
            print(f"resume=latest and launch eval latest: {printable(newest.parent.parent)} (its checkpoint, "
                  f"written {written}, is the newest under outputs/; sweep runs are named by their dir)")
    return 0
