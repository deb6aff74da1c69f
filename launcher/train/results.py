"""What a run reports: each epoch's line in the log, and at its end (`finish`) results.json (rank 0), written
from the run's record (`RunRecord`) before the end's other files (`EndWrites`)."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from launcher.config import DEFAULT_OBJECTIVE, Config, minimized, model_name
from launcher.errors import ExplainedStop
from launcher.files import CURVES, RESULTS, DiskFull, disk_full, free_bytes
from launcher.strategies import recompute
from launcher.train import reporting, trackers
from launcher.train.early_stop import default_figure
from launcher.train.metrics import write_results

if TYPE_CHECKING:
    from launcher.figures import NamedFigures
    from launcher.recipes import Recipe
    from launcher.strategies import Nets, Strategy

log = logging.getLogger("launcher.train")


@dataclass
class Timings:
    """A run's time, summed on the device's own clock (CUDA events) where it has one."""

    train_s: float = 0.0
    eval_s: float = 0.0
    warmup_s: float | None = None  # compile and capture, before any clock started
    first_step_s: float | None = None  # from the command's start to the first step's end


@dataclass(frozen=True)
class RankFacts:
    """Every rank's weights digest, device names and machine, in rank order (`gather`)."""

    digests: list[str]
    devices: list[str]  # (a rank of strategy=dp drives several)
    hosts: list[str]

    @classmethod
    def gather(cls, strategy: Strategy, nets: Nets, device: torch.device) -> RankFacts:
        """Gathered from every rank (a collective); replicas that ended with different weights said on rank 0."""
        mine = (strategy.weights_digest(nets), strategy.device_names(device), socket.gethostname())
        everyone = strategy.gather(mine)
        digests = [d for d, _, _ in everyone]
        if len(set(digests)) > 1 and strategy.is_main:
            log.warning("ranks ended with DIFFERENT weights (digests %s): the replicas diverged", digests)
        return cls(digests, [name for _, names, _ in everyone for name in names], [host for _, _, host in everyone])


@dataclass(frozen=True)
class RunRecord:
    """What results.json says of a finished run beside its epochs' rows, as the loop filled it at the end."""

    cfg: Config  # the settings it ran with (what actually ran: the plan's)
    strategy: str
    world_size: int
    batch_per_process: int
    gradient_sync: str | None
    sharding: str | None  # (fsdp's units; None under the other strategies)
    device_type: str
    ranks: RankFacts
    synthetic_data: bool
    data_placement: str
    compiled: bool
    compile_decision: str
    cuda_graph: bool  # the step was replayed as one CUDA graph
    cudnn_benchmark: bool
    fp16: bool
    stopped_early: dict[str, Any] | None  # why the run stopped before its last epoch (early_stop)
    best_checkpoint: dict[str, Any] | None  # checkpoint.keep_best: the figure and the epochs kept
    timings: Timings
    started_unix: float  # when `launch` began: first_step_s counts from it
    startup: dict[str, Any]  # the start-up's milestones (timeline.py)
    resumed_from: str | None
    restarts: int
    worker_s: float


def epoch_line(row: dict[str, Any], epochs: int, unit: str) -> str:
    """An epoch's line in the log: loss, accuracies, the recipe's own figures, speed, input wait, time."""
    parts = [f"epoch {row['epoch']:{len(str(epochs))}d}/{epochs}", f"loss {row['loss']:.4f}"]
    if "train_acc" in row:
        parts.append(f"train {100 * row['train_acc']:.2f}%")
    if "test_acc" in row:
        parts.append(f"test {100 * row['test_acc']:.2f}%")
    elif "train_acc" in row:
        parts.append("test -")
    shown = {"train_acc", "test_acc"}
    # the recipe's own figures (train_NAME, test_NAME), the held-out loss where no accuracy says it,
    # and what its report adds
    for key, value in row.items():
        named = key.startswith(("train_", "test_")) and key not in ("train_s",)
        if (named or key in ("test_bpb", "mfu")) and key not in shown and isinstance(value, (int, float)):
            if key == "test_loss" and "test_acc" in row:
                continue
            parts.append(f"{key} {value:.4g}" if key != "test_bpb" else f"{key} {value:.3f}")
    parts.append(f"{row[f'{unit}_per_s']:,.0f} {unit}/s")
    if row.get("skipped"):
        parts.append(f"skipped {row['skipped']}")
    if row.get("eval_skipped"):
        parts.append(f"skipped in evaluation {row['eval_skipped']}")
    if row.get("overflow_steps"):
        parts.append(f"fp16 overflow {row['overflow_steps']} steps (skipped)")
    parts += [f"input wait {100 * row['input_stall']:.1f}%", f"{row['epoch_s']:.2f}s"]
    if row.get("stopped_early"):
        parts.append(f"stopping early: {row['stopped_early']}")
    return "  ".join(parts)


def write(run_dir: Path, record: RunRecord, history: list[dict[str, Any]]) -> dict[str, Any]:
    """results.json of a finished run (rank 0), from its record and the epochs' history; returned."""
    cfg, t, digests = record.cfg, record.timings, record.ranks.digests
    final = history[-1] if history else {}
    scored = [r["test_acc"] for r in history if "test_acc" in r]
    stalls = [r["input_stall"] for r in history]
    objective = cfg.sweep.objective
    if objective == DEFAULT_OBJECTIVE:
        # (a recipe with figures of its own and no accuracy: its first held-out figure, test_mse say)
        objective = default_figure(final) or objective
    ranked = [r[objective] for r in history if isinstance(r.get(objective), (int, float))]
    best = ((min if minimized(objective, cfg.sweep.direction) else max)(ranked) if ranked else None)
    timed = {"train_s": t.train_s, "eval_s": t.eval_s, "train_eval_s": t.train_s + t.eval_s,
             "clock": "cuda events" if record.device_type == "cuda" else "host clock",
             "compile_warmup_s": t.warmup_s}
    results = {
        "recipe": cfg.recipe.name,
        "model": model_name(cfg),
        "strategy": record.strategy,
        "world_size": record.world_size,
        "device_type": record.device_type,
        "devices": record.ranks.devices,
        "hosts": record.ranks.hosts,  # each rank's machine, in rank order
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "epochs": cfg.epochs,
        "batch_size": cfg.batch_size,
        "batch_per_process": record.batch_per_process,
        "synthetic_data": record.synthetic_data,
        "data_placement": record.data_placement,
        "compiled": record.compiled,
        "compile_decision": record.compile_decision,
        "cuda_graph": record.cuda_graph,
        "cudnn_benchmark": record.cudnn_benchmark,
        "gradient_sync": record.gradient_sync,
        "sharding": record.sharding,  # (fsdp's units; None under the other strategies)
        "activation_checkpointing": recompute.mode_of(cfg).value,  # none, full or selective
        "precision": cfg.perf.precision.value,  # auto, bf16, fp16, fp32 or fp8
        "final": final,
        "test_acc": final.get("test_acc"),
        "best_test_acc": max(scored, default=None),
        # every figure of the last epoch, by name (what sweep.objective may name), and the objective's best
        **{k: v for k, v in final.items() if k.startswith("test_") and k != "test_acc"},
        "objective": objective,
        f"best_{objective}": best,
        "epochs_run": len(history),
        "stopped_early": record.stopped_early,  # None, or why the run stopped before its last epoch (early_stop)
        "best_checkpoint": record.best_checkpoint,
        "skipped_samples": sum(int(r.get("skipped", 0)) for r in history),
        # (each evaluation reads the same files: the last one's count)
        "skipped_eval_samples": int(final.get("eval_skipped", 0)),
        **({"overflow_steps": sum(int(r.get("overflow_steps", 0)) for r in history)} if record.fp16 else {}),
        "train_s": t.train_s,
        "timed": timed,
        "input_stall": round(sum(stalls) / len(stalls), 4) if stalls else None,
        "worker_s": record.worker_s,
        "first_step_s": t.first_step_s,
        "started_unix": record.started_unix,  # when `launch` began: first_step_s counts from it
        "startup": record.startup,
        "resumed_from": record.resumed_from,
        "restarts": record.restarts,
        "weights_sha256": digests,
        # (replicas hold the same weights; sharded ranks hold different parts, and each reports one digest of
        # all the parts: null, as nothing is compared)
        "ranks_agree": len(set(digests)) == 1 if record.sharding is None else None,
        "torch": torch.__version__,
    }
    write_results(run_dir, results)
    return results


def finish(run_dir: Path, record: RunRecord, history: list[dict[str, Any]], recipe: Recipe, nets: Nets,
           strategy: Strategy, device: torch.device, tensorboard: reporting.TensorBoardLog, tracked: trackers.Trackers,
           named_figures: NamedFigures) -> dict[str, Any] | None:
    """The run's files at its end, the figures first: results.json (rank 0; small, atomic), then the
    recipe's finish (a sample; its facts join results.json), TensorBoard's last events, curves.png and the
    trackers, each attempted on its own (EndWrites): a file that cannot be written (a full disk) is named,
    leaves no partial file, and ends the run with exit 1, the figures kept. Returns results.json's contents
    on rank 0, None elsewhere."""
    cfg, is_main = record.cfg, strategy.is_main
    ending = EndWrites(run_dir)
    outcome = write(run_dir, record, history) if is_main else None
    # (a sharded model's forward takes every rank, so all of them run the recipe's finish)
    if is_main or strategy.sharded:
        with ending.attempt(f"what recipe={cfg.recipe.name}'s finish writes in {run_dir}"):
            finished = recipe.finish(nets.module, run_dir, device, is_main)
            if outcome is not None and finished:
                add_facts(run_dir, outcome, finished)
    # (the trained weights for MLflow or W&B to keep; gathered from every rank's shards under fsdp)
    state = strategy.state_dict(nets) if tracked.want_weights or (
        strategy.sharded and (cfg.log.mlflow or cfg.log.wandb)) else None
    if outcome is None:
        return None
    with ending.attempt(tensorboard.folder):
        tensorboard.close()
    with ending.attempt(run_dir / CURVES):
        reporting.plot_curves(history, run_dir / CURVES)
    if tracked.active:
        weights = trackers.weights_file(state) if state else None
        tracked.finish(outcome, [run_dir / CURVES, run_dir / RESULTS], weights)
        tracked.ok = True
    ending.check()
    named_figures.check_results(outcome)  # (a sweep.objective that is no figure: a value of results.json)
    return outcome


def add_facts(run_dir: Path, results: dict[str, Any], facts: dict[str, Any]) -> None:
    """The recipe's facts (its `finish`) added to results.json, written again (atomically)."""
    results.update(facts)
    write_results(run_dir, results)


class EndWrites:
    """The files a finished run writes after results.json (rank 0): its figures go first, small and atomic
    (`write`); then the large or optional ones (the recipe's sample and facts, TensorBoard's last flush,
    curves.png, the trackers), each `attempt`ed on its own, so that one that cannot be written (a full
    disk) stops none of the others and leaves no partial file where the launcher writes it (atomic writes).
    `check` then ends the run with one line naming every file not written (exit 1: the run did not record
    everything), its figures kept."""

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self.unwritten: list[tuple[Path | str, BaseException]] = []

    @contextlib.contextmanager
    def attempt(self, what: Path | str) -> Iterator[None]:
        """Write `what` (a file, or what a block writes: the failure names its own file where it can) or
        record why it failed."""
        try:
            yield
        except (OSError, DiskFull) as exc:
            named = getattr(exc, "path", None) or getattr(exc, "filename", None) or what
            self.unwritten.append((named, exc))
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc).split(":")[0]
            log.warning("writing %s failed: %s", named, reason, extra={"file_only": True})  # (`check` says it)

    def check(self) -> None:
        if not self.unwritten:
            return
        files = " and ".join(str(path) for path, _ in self.unwritten)
        kept = f"{self.run_dir / RESULTS} holds the run's figures"
        if any(isinstance(exc, DiskFull) or disk_full(self.run_dir, exc) for _, exc in self.unwritten):
            free = free_bytes(self.run_dir)
            shown = f"{free / 1e6:.1f} MB free" if free is not None else "no space"
            raise ExplainedStop(f"No space left on device: writing {files} failed ({shown} on that file system); "
                                f"{kept}; free some space (metrics.jsonl and any checkpoint are whole)")
        first = self.unwritten[0][1]
        raise ExplainedStop(f"writing {files} failed ({type(first).__name__}: {first}); {kept}")
