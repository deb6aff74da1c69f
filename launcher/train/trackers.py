"""The trackers an epoch's figures go to besides metrics.jsonl: `log=[tensorboard,mlflow,csv,wandb]`.

    launch log=[tensorboard,mlflow,csv]                                 several at once
    launch log=[mlflow] log.mlflow.tracking_uri=http://127.0.0.1:5000   a shared MLflow server
    launch log=[wandb]                                                  W&B, offline: `wandb sync` sends it later

Only rank 0 logs. TensorBoard is written on the training thread (launcher/train/reporting.py: it is cheap
and measured so); every other tracker here runs on one thread of its own (`Trackers`), so a slow server
never holds up a step, and a tracker that fails mid-run is said once and left out from then on: the run
and its own files (metrics.jsonl, results.json, checkpoints) go on as if it had never been picked. Whether
each is installed, and an MLflow server reachable, was checked before any worker started
(launcher/host/trackers.py).

A sweep's runs (their run dirs lie in a dir `launch -m` marked, files.SWEEP_MARK) are grouped: under one
MLflow parent run, in one W&B group. A run restarted in its own run dir (max_restarts, a SLURM requeue)
goes on logging to the same MLflow or W&B run.

To add a tracker: its class here (a Tracker: start, epoch, finish, close), its schema in launcher/config.py
(a field of LogConfig, TRACKER_PACKAGES) and conf/log/<name>.yaml.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import queue
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from launcher.config import Config, flat_keys, to_plain
from launcher.files import SWEEP_MARK, read_json, write_json, write_text_atomic

log = logging.getLogger("launcher.train")

CLOSE_TIMEOUT_S = 120.0  # at the run's end: how long the trackers' thread may take to send what is queued
NOT_FIGURES = ("epoch", "started_unix", "resumed_at_step")


def figures(row: dict[str, Any]) -> dict[str, float]:
    """An epoch row's numbers a tracker plots (finite, not the epoch's own number or its clock time)."""
    return {k: float(v) for k, v in row.items() if k not in NOT_FIGURES and isinstance(v, (int, float))
            and not isinstance(v, bool) and math.isfinite(v)}


@dataclass
class RunInfo:
    """What every tracker knows of the run when it starts."""

    run_dir: Path
    config: Config
    history: list[dict[str, Any]] = field(default_factory=list)  # epochs a resume brought along
    restarted: bool = False  # the same run dir again (max_restarts, a requeue): the same tracker run

    @property
    def name(self) -> str:
        return self.run_dir.name

    @property
    def sweep_dir(self) -> Path | None:
        """The sweep dir this run belongs to, or None for a run on its own."""
        parent = self.run_dir.parent
        return parent if (parent / SWEEP_MARK).is_file() else None

    @property
    def params(self) -> dict[str, Any]:
        """The resolved config as flat dotted keys (the free-form sections' values too)."""
        return flat_keys(to_plain(self.config))


class Tracker:
    name = "tracker"

    def start(self, info: RunInfo) -> None: ...

    def epoch(self, row: dict[str, Any]) -> None: ...

    def finish(self, results: dict[str, Any], files: list[Path], weights: Path | None) -> None: ...

    def close(self, ok: bool) -> None: ...


class CsvTracker(Tracker):
    """metrics.csv in the run dir: one row per epoch, a column per figure (in the order they first appear),
    rewritten whole each epoch (atomically: a reader never sees half a file; a figure that appears in a
    later epoch gets its column)."""

    name = "csv"

    def __init__(self, section: Any, run_dir: Path):
        self.path = Path(run_dir) / section.file
        self.rows: list[dict[str, Any]] = []

    def start(self, info: RunInfo) -> None:
        self.rows = [dict(r) for r in info.history]
        if self.rows:
            self._write()

    def epoch(self, row: dict[str, Any]) -> None:
        self.rows.append(dict(row))
        self._write()

    def _write(self) -> None:
        import csv
        import io

        columns: list[str] = []
        for row in self.rows:
            columns += [k for k in row if k not in columns and not isinstance(row[k], (dict, list))]
        out = io.StringIO()
        writer = csv.DictWriter(out, fieldnames=columns, extrasaction="ignore", lineterminator="\n")
        writer.writeheader()
        for row in self.rows:
            writer.writerow({k: ("" if v is None or (isinstance(v, float) and not math.isfinite(v)) else v)
                             for k, v in row.items()})
        write_text_atomic(self.path, out.getvalue())


class MlflowTracker(Tracker):
    """MLflow through its own client (MlflowClient): an experiment (the recipe's name), one run per run dir
    (its id kept in RUN_DIR/.mlflow-run.json, so a restart logs to the same run), the resolved config as
    params, every epoch's figures as metrics at step = epoch, and at the end curves.png, results.json and
    the trained weights (model/model.pt, a plain state_dict as `launch export` writes) as artifacts."""

    name = "mlflow"
    ID_FILE = ".mlflow-run.json"
    PARENT_FILE = ".mlflow-parent.json"  # in a sweep dir: the parent run, per tracking URI and experiment

    def __init__(self, section: Any, run_dir: Path):
        self.section = section
        self.run_dir = Path(run_dir)
        self.client: Any = None
        self.run_id: str | None = None
        self.uri, self.experiment_id = "", ""

    def _uri(self) -> str:
        import mlflow

        uri = self.section.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or mlflow.get_tracking_uri()
        uri = str(uri)
        if uri.startswith("file:") or "://" not in uri:
            # A file store, named by the user: MLflow 3 wants this said (it recommends a database now).
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
            uri = "sqlite:///" + os.path.abspath(uri[len("sqlite:///"):])  # (relative: to where launch runs)
        return uri

    def start(self, info: RunInfo) -> None:
        # A server that goes away mid-run fails a call within seconds (MLflow's default retries for about two
        # minutes, each retry a console line): the tracker is then said once and left out.
        for key, value in (("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2"), ("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1"),
                           ("MLFLOW_HTTP_REQUEST_TIMEOUT", "20"),
                           # (MLflow prints two "View run" lines of its own on every run it ends, a sweep's parent
                           # included, straight to stdout: the run's address is said once, in close)
                           ("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")):
            os.environ.setdefault(key, value)
        logging.getLogger("urllib3.connectionpool").setLevel(logging.ERROR)
        logging.getLogger("mlflow.store.db.utils").setLevel(logging.WARNING)
        from mlflow.tracking import MlflowClient

        uri = self._uri()
        self.client = MlflowClient(tracking_uri=uri)
        experiment = self.section.experiment or info.config.recipe.name
        experiment_id = self._experiment(experiment)
        saved = read_json(self.run_dir / self.ID_FILE)
        self.uri, self.experiment_id = uri, experiment_id
        if saved.get("tracking_uri") == uri and saved.get("run_id"):
            self.run_id = str(saved["run_id"])
            self.client.update_run(self.run_id, status="RUNNING")
            if not info.restarted:
                self._log_params(info.params)
            return
        tags = {"launch.run_dir": str(self.run_dir), "launch.recipe": info.config.recipe.name,
                **{str(k): str(v) for k, v in (self.section.tags or {}).items()}}
        sweep = info.sweep_dir
        if sweep is not None:
            tags["launch.sweep_dir"] = str(sweep)
            tags["mlflow.parentRunId"] = self._parent(experiment_id, sweep, uri)
        name = self.section.run_name or (f"{sweep.name}/{info.name}" if sweep is not None else info.name)
        run = self.client.create_run(experiment_id, run_name=name, tags=tags)
        self.run_id = run.info.run_id
        write_json(self.run_dir / self.ID_FILE, {"tracking_uri": uri, "run_id": self.run_id,
                                                 "experiment_id": experiment_id})
        self._log_params(info.params)
        for row in info.history:  # (a resume's earlier epochs: the curves start where the run did)
            self.epoch(row)

    def _experiment(self, name: str) -> str:
        found = self.client.get_experiment_by_name(name)
        if found is not None:
            return found.experiment_id
        try:
            return self.client.create_experiment(name)
        except Exception:  # (another run created it meanwhile: a sweep's runs start together)
            found = self.client.get_experiment_by_name(name)
            if found is None:
                raise
            return found.experiment_id

    def _parent(self, experiment_id: str, sweep: Path, uri: str) -> str:
        """The sweep's parent run, made by the first of its runs to get here (a lock in the sweep dir)."""
        import fcntl

        with open(sweep / ".mlflow-parent.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            known = read_json(sweep / self.PARENT_FILE)
            key = f"{uri} {experiment_id}"
            if key not in known:
                parent = self.client.create_run(experiment_id, run_name=sweep.name,
                                                tags={"launch.sweep_dir": str(sweep), "launch.sweep": "parent"})
                self.client.set_terminated(parent.info.run_id, "FINISHED")
                known[key] = parent.info.run_id
                write_json(sweep / self.PARENT_FILE, known)
            return str(known[key])

    def _log_params(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        items = [Param(k[:250], json.dumps(v) if isinstance(v, (list, dict)) else str(v))
                 for k, v in sorted(params.items())]
        items = [Param(p.key, p.value[:6000]) for p in items]
        for i in range(0, len(items), 100):  # (MLflow takes 100 params a batch)
            with contextlib.suppress(Exception):  # (a restarted run's params are there already)
                self.client.log_batch(self.run_id, params=items[i:i + 100])

    def epoch(self, row: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, int(row["epoch"])) for k, v in figures(row).items()]
        for i in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000])

    def finish(self, results: dict[str, Any], files: list[Path], weights: Path | None) -> None:
        for path in files:
            if path.is_file():
                self.client.log_artifact(self.run_id, str(path))
        if weights is not None and weights.is_file():
            self.client.log_artifact(self.run_id, str(weights), artifact_path="model")
        stopped = results.get("stopped_early")
        if stopped:
            self.client.set_tag(self.run_id, "launch.stopped_early", stopped.get("reason", ""))

    def close(self, ok: bool) -> None:
        if self.client is not None and self.run_id is not None:
            self.client.set_terminated(self.run_id, "FINISHED" if ok else "FAILED")
            if self.uri.startswith(("http://", "https://")):
                log.info("mlflow: this run is at %s/#/experiments/%s/runs/%s", self.uri.rstrip("/"),
                         self.experiment_id, self.run_id)


class WandbTracker(Tracker):
    """Weights & Biases, offline unless log.wandb.mode says otherwise: written under RUN_DIR/wandb, nothing
    sent until `wandb sync`. The resolved config as the run's config, every epoch's figures at step = epoch,
    results.json's numbers as its summary, curves.png, results.json and the weights saved with it."""

    name = "wandb"

    def __init__(self, section: Any, run_dir: Path):
        self.section = section
        self.run_dir = Path(run_dir)
        self.run: Any = None

    def start(self, info: RunInfo) -> None:
        import wandb

        id_file = self.run_dir / ".wandb-run.json"
        saved = read_json(id_file).get("id")
        sweep = info.sweep_dir
        self.run = wandb.init(
            mode=str(self.section.mode), project=self.section.project or f"launch-{info.config.recipe.name}",
            entity=self.section.entity, dir=str(self.run_dir), name=info.name, id=saved or None,
            resume="allow" if saved else None, group=sweep.name if sweep is not None else None,
            tags=list(self.section.tags or []) or None, config=info.params,
            settings=wandb.Settings(console="off", silent=True, x_disable_stats=True))
        if not saved:
            write_json(id_file, {"id": self.run.id})
        for row in info.history if not info.restarted else []:
            self.epoch(row)

    def epoch(self, row: dict[str, Any]) -> None:
        self.run.log(figures(row), step=int(row["epoch"]))

    def finish(self, results: dict[str, Any], files: list[Path], weights: Path | None) -> None:
        import wandb

        self.run.summary.update({k: v for k, v in results.items() if isinstance(v, (int, float, str, bool))})
        outputs = wandb.Artifact(f"{self.run.id}-outputs", type="run-outputs")
        for path in files:
            if path.is_file():
                outputs.add_file(str(path))
        self.run.log_artifact(outputs)
        if weights is not None and weights.is_file():
            model = wandb.Artifact(f"{self.run.id}-model", type="model")
            model.add_file(str(weights))
            self.run.log_artifact(model)

    def close(self, ok: bool) -> None:
        if self.run is not None:
            self.run.finish(exit_code=0 if ok else 1)
            import wandb

            with contextlib.suppress(Exception):
                wandb.teardown()  # (its service process ends with the run, not with this process)


TRACKERS: dict[str, Callable[[Any, Path], Tracker]] = {"csv": CsvTracker, "mlflow": MlflowTracker,
                                                       "wandb": WandbTracker}


class Trackers:
    """Rank 0's trackers (all but TensorBoard), fed on one thread of their own, in order. A tracker whose
    call raises is said once and dropped; nothing it does can stop the run."""

    def __init__(self, cfg: Config, run_dir: Path, enabled: bool):
        self.trackers = [TRACKERS[name](getattr(cfg.log, name), Path(run_dir))
                         for name in cfg.log.chosen if name in TRACKERS] if enabled else []
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._started: threading.Event | None = None
        self.ok = False  # the run ended well (set before close)

    @property
    def active(self) -> bool:
        return bool(self.trackers)

    @property
    def want_weights(self) -> bool:
        """Whether a tracker keeps the trained weights (the run writes them for it at the end)."""
        return any(isinstance(t, (MlflowTracker, WandbTracker)) for t in self.trackers)

    def start(self, history: list[dict[str, Any]], restarted: bool) -> None:
        if not self.trackers:
            return
        self._thread = threading.Thread(target=self._serve, name="launcher-trackers", daemon=True)
        self._thread.start()
        info = RunInfo(self.run_dir, self.cfg, list(history), restarted)
        self._each("start", info)
        self._started = threading.Event()
        self._queue.put(self._started.set)

    def wait_started(self) -> None:
        """Until every tracker has started (its package imported, its run made): called before the first
        epoch, so that the imports (mlflow's is slow; measured: BENCHMARKS.md section 12) overlap the warm-up,
        never a timed epoch."""
        if self._started is not None:
            self._started.wait()
            self._started = None

    def epoch(self, row: dict[str, Any]) -> None:
        self._each("epoch", dict(row))

    def finish(self, results: dict[str, Any], files: list[Path], weights: Path | None) -> None:
        self._each("finish", results, files, weights)
        if weights is not None:  # (the temporary copy goes once every tracker has it)
            self._queue.put(lambda: shutil.rmtree(weights.parent, ignore_errors=True))

    def _each(self, method: str, *args: Any) -> None:
        for tracker in self.trackers:
            self._queue.put((tracker, method, args))

    def _serve(self) -> None:
        failed: set[str] = set()
        while True:
            item = self._queue.get()
            if item is None:
                return
            if callable(item):
                item()
                continue
            tracker, method, args = item
            if tracker.name in failed:
                continue
            try:
                getattr(tracker, method)(*args)
            except Exception as exc:  # noqa: BLE001 - a tracker's failure is said, never the run's
                failed.add(tracker.name)
                first = str(exc).strip().splitlines()[0][:400] if str(exc).strip() else type(exc).__name__
                log.warning("log: %s failed (%s: %s) and is left out from here on; the run goes on, its own "
                            "files (metrics.jsonl, results.json, checkpoints) are in %s", tracker.name,
                            type(exc).__name__, first, self.run_dir)
                with contextlib.suppress(Exception):
                    tracker.close(False)

    def close(self) -> None:
        """Send what is queued (CLOSE_TIMEOUT_S at most), then end each tracker's run."""
        if self._thread is None:
            return
        self._each("close", self.ok)
        self._queue.put(None)
        self._thread.join(CLOSE_TIMEOUT_S)
        if self._thread.is_alive():
            log.warning("log: the trackers were still sending after %.0f s; stopped waiting (the run's own files "
                        "are complete in %s)", CLOSE_TIMEOUT_S, self.run_dir)
        self._thread = None


def weights_file(state: dict[str, Any]) -> Path:
    """The trained weights as a plain state_dict in a temporary folder (for the trackers to keep)."""
    import torch

    folder = Path(tempfile.mkdtemp(prefix="launch-weights-"))
    path = folder / "model.pt"
    torch.save({k: v.detach().cpu().contiguous() for k, v in state.items()}, path)
    return path
