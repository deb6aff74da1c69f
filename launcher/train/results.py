"""What a run reports: each epoch's line in the log, and results.json at the end (rank 0), before the
end's other files (`EndWrites`)."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from launcher.config import DEFAULT_OBJECTIVE, minimized, model_name
from launcher.errors import ExplainedStop
from launcher.files import RESULTS, DiskFull, disk_full, free_bytes
from launcher.train.early_stop import default_figure
from launcher.train.metrics import write_results

log = logging.getLogger("launcher.train")


@dataclass
class Timings:
    """A run's time, summed on the device's own clock (CUDA events) where it has one."""

    train_s: float = 0.0
    eval_s: float = 0.0
    warmup_s: float | None = None  # compile and capture, before any clock started
    first_step_s: float | None = None  # from the command's start to the first step's end


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


def write(trainer: Any, history: list[dict[str, Any]], digests: list[str], devices: list[str],
          resumed_from: str | None, total_s: float, recipe_facts: dict[str, Any]) -> dict[str, Any]:
    """results.json of a finished run (rank 0), from the trainer's facts and the epochs' history; returned."""
    cfg, s, t = trainer.cfg, trainer.strategy, trainer.timings
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
             "clock": "cuda events" if trainer.device.type == "cuda" else "host clock",
             "compile_warmup_s": t.warmup_s}
    results = {
        "recipe": cfg.recipe.name,
        "model": model_name(cfg),
        "strategy": s.name,
        "world_size": s.world_size,
        "device_type": trainer.device.type,
        "devices": devices,
        "hosts": trainer.hosts,  # each rank's machine, in rank order
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "epochs": cfg.epochs,
        "batch_size": cfg.batch_size,
        "batch_per_process": s.batch_per_process,
        "synthetic_data": trainer.data.synthetic,
        "data_placement": trainer.data.placement,
        "compiled": trainer.compiled.compile,
        "compile_decision": trainer.compiled.why,
        "cuda_graph": trainer.step.captured is not None,
        "cudnn_benchmark": trainer.device.type == "cuda" and torch.backends.cudnn.benchmark,
        "gradient_sync": s.gradient_sync,
        "sharding": s.layout,  # (fsdp's units; None under the other strategies)
        "final": final,
        "test_acc": final.get("test_acc"),
        "best_test_acc": max(scored, default=None),
        # every figure of the last epoch, by name (what sweep.objective may name), and the objective's best
        **{k: v for k, v in final.items() if k.startswith("test_") and k != "test_acc"},
        "objective": objective,
        f"best_{objective}": best,
        "epochs_run": len(history),
        "stopped_early": trainer.stopped_early,  # None, or why the run stopped before its last epoch (early_stop)
        "best_checkpoint": ({"metric": trainer.best.key, "kept": trainer.best.kept}
                            if trainer.best is not None else None),
        "skipped_samples": sum(int(r.get("skipped", 0)) for r in history),
        # (each evaluation reads the same files: the last one's count)
        "skipped_eval_samples": int(final.get("eval_skipped", 0)),
        **({"overflow_steps": sum(int(r.get("overflow_steps", 0)) for r in history)} if trainer.fp16 else {}),
        "train_s": t.train_s,
        "timed": timed,
        "input_stall": round(sum(stalls) / len(stalls), 4) if stalls else None,
        "worker_s": total_s,
        "first_step_s": t.first_step_s,
        "started_unix": trainer.spec.started_at,  # when `launch` began: first_step_s counts from it
        "startup": trainer.timeline.as_dict(),
        "resumed_from": resumed_from,
        "restarts": trainer.world.restart_count,
        "weights_sha256": digests,
        "ranks_agree": len(set(digests)) == 1,
        "torch": torch.__version__,
        **recipe_facts,
    }
    write_results(trainer.run_dir, results)
    return results


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
