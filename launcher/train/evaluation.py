"""The held-out evaluation: the recipe's eval_step over this rank's shard of the test split, summed on the
device and read with the epoch's other figures (launcher/train/loop.py), or read at once (`launch eval`).

With several ranks every one holds the same weights (buffers are averaged first), so each scores a disjoint
shard, and the sums and counts are added up when read: each figure is exact over the whole evaluation set.
Under fsdp every forward is a collective, so every rank runs as many chunks (`eval_chunks(equal_counts)`)
and warms up with the same forwards (`warm_up_chunks`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from launcher.config import Config
from launcher.data.placement import Data, eval_chunks, warm_up_chunks
from launcher.data.prefetch import batch_len
from launcher.figures import LauncherFigures, check_step_names
from launcher.files import CONFUSION, EVAL, write_json
from launcher.train import reporting
from launcher.train.stall import StepClock
from launcher.train.step import Figures, eval_figures

if TYPE_CHECKING:
    from launcher.recipes import Recipe
    from launcher.strategies import Nets, Strategy


@dataclass
class QueuedEvaluation:
    """An evaluation queued on the device: its sums stay there until read."""

    figures: Figures  # the recipe's eval_step figures: sums and counts
    clock: StepClock
    matrix: torch.Tensor | None = None  # the confusion matrix, flattened (`launch eval`)
    skipped: int = 0  # evaluation samples this rank's Dataset skipped (bad files, data.on_bad_file=skip)


class Evaluation:
    def __init__(self, cfg: Config, recipe: Recipe, strategy: Strategy, device: torch.device,
                 autocast: Callable[[], torch.autocast], timings: Any):
        self.cfg, self.recipe, self.strategy, self.device = cfg, recipe, strategy, device
        self.autocast = autocast
        self.timings = timings  # (its warmup_s counts the evaluation's warm-up too)
        self.warm = False  # the warm-up ran (after each compile it runs again)
        self.named: set[str] = set()  # the eval_step's figure names checked so far (once each)

    def after(self, epoch: int) -> bool:
        """Whether the run evaluates after `epoch` (eval.every; always after the last)."""
        every = self.cfg.eval.every
        return epoch + 1 == self.cfg.epochs or (every > 0 and (epoch + 1) % every == 0)

    def chunks(self, data: Data) -> list[torch.Tensor]:
        s = self.strategy
        return eval_chunks(len(data.test), self._chunk(), s.world_size, s.rank, equal_counts=s.lockstep_eval)

    def _chunk(self) -> int:
        share = max(1, self.cfg.eval.batch_size // self.strategy.world_size)
        limit = self.recipe.eval_chunk_limit()
        return share if limit is None else min(share, limit)

    @staticmethod
    def inputs(data: Data, batch: Any) -> Any:
        """An evaluation batch as eval_step takes it: in-memory images normalized (no augmentation)."""
        if not data.in_memory:
            return batch
        return (data.normalize(batch[0]), *batch[1:])

    @torch.no_grad()
    def queue(self, nets: Nets, data: Data, warmed: bool, confusion: bool = False) -> QueuedEvaluation:
        """The recipe's evaluation figures (`eval_step`) summed on the device with their counts (and the
        confusion matrix), queued without waiting. `warmed`: the run is compiled or captured, so the first
        evaluation warms up first (untimed)."""
        nets.eval.eval()
        chunks = self.chunks(data)
        if not self.warm:
            self._warm_up(nets, data, chunks, warmed)
        figures = Figures(self.device)
        classes = data.num_classes
        matrix = torch.zeros(classes * classes, device=self.device) if confusion else None
        clock = StepClock(self.device)
        clock.start()
        skipped_before = getattr(data.test, "skipped", 0)
        for batch, _ in data.test.batches(chunks):
            batch = self.inputs(data, batch)
            with self.autocast():
                if matrix is None:
                    scored = eval_figures(self.recipe.eval_step(nets.eval, batch))
                else:  # (the built-in classifiers: the predictions also fill the confusion matrix)
                    logits = self.recipe.predict(nets.eval, batch[0])
                    logits, y = logits.flatten(0, -2), batch[1].flatten()
                    predicted = logits.argmax(-1)
                    scored = LauncherFigures(loss=torch.nn.functional.cross_entropy(logits.float(), y,
                                                                                    reduction="none"),
                                             acc=predicted == y)
                    matrix += torch.bincount(y * classes + predicted, minlength=classes * classes)
            if not self.named.issuperset(scored):
                check_step_names("eval_step", scored)
                self.named.update(scored)
            n = batch_len(batch)
            for name, value in scored.items():
                figures.add(name, value, n)
        clock.step_end()
        return QueuedEvaluation(figures, clock, matrix, getattr(data.test, "skipped", 0) - skipped_before)

    def read_now(self, nets: Nets, data: Data, warmed: bool, confusion: bool = False) -> dict[str, Any]:
        """An evaluation read at once (`launch eval`): the test_NAME figures, eval_s (and the confusion matrix)."""
        s = self.strategy
        queued = self.queue(nets, data, warmed, confusion=confusion)
        names = queued.figures.names
        values = s.all_reduce(torch.stack(queued.figures.tensors())).tolist() if names else []
        row: dict[str, Any] = {f"test_{k}": v for k, v in Figures.means(names, values).items()}
        row["eval_s"] = queued.clock.finish().span_s
        skipped = int(s.reduce_host([float(queued.skipped)])[0])
        if skipped:
            row["eval_skipped"] = skipped
        if queued.matrix is not None:
            classes = data.num_classes
            row["confusion"] = [[int(v) for v in r]
                                for r in s.all_reduce(queued.matrix).view(classes, classes).tolist()]
        return row

    def write_report(self, run_dir: Path, facts: dict[str, Any], row: dict[str, Any], data: Data,
                     started: float) -> dict[str, Any]:
        """`launch eval`'s eval.json (rank 0): `facts` (what was evaluated, on what) and the figures of `row`
        (`read_now`'s); where it holds the confusion matrix (a built-in classifier), the test images, the
        accuracy per class, and confusion.png. `started`: perf_counter() when the evaluation began."""
        if "confusion" not in row:
            report = {**facts, **row, "worker_s": time.perf_counter() - started, "torch": torch.__version__}
            write_json(run_dir / EVAL, report)
            return report
        confusion = row.pop("confusion")
        counts = [sum(r) for r in confusion]
        per_class = [confusion[i][i] / counts[i] if counts[i] else None for i in range(len(confusion))]
        names = self.class_names(data, len(confusion))
        report = {
            **facts, "test_images": int(sum(counts)), "unit": data.unit, **row, "classes": names,
            "per_class_acc": dict(zip(names, per_class, strict=True)), "confusion": confusion,
            "worker_s": time.perf_counter() - started, "torch": torch.__version__,
        }
        write_json(run_dir / EVAL, report)
        reporting.plot_confusion(confusion, names, run_dir / CONFUSION)
        return report

    def class_names(self, data: Data, count: int) -> list[str]:
        """named_classes of the evaluation split, else the class indices."""
        names = named_classes(self.recipe, data, data.test)
        return names if len(names) == count else [str(i) for i in range(count)]

    @torch.no_grad()
    def _warm_up(self, nets: Nets, data: Data, chunks: list[torch.Tensor], warmed: bool) -> None:
        """Before the first timed evaluation of a warmed-up run (compiled or captured): one untimed forward
        pass per distinct chunk size (under fsdp: the same ones on every rank), so cuDNN's autotuning (and
        compiling, where evaluation is compiled) stays out of eval_s as it did out of the training clock.
        Deferred from the training warm-up to here so that the first training step does not wait for it.
        Eval-mode forwards change no state."""
        self.warm = True
        if not warmed or not data.in_memory:
            return
        start = time.perf_counter()
        s = self.strategy
        for batch, _ in data.test.batches(warm_up_chunks(chunks, len(data.test), self._chunk(), s.world_size,
                                                         s.lockstep_eval)):
            with self.autocast():
                self.recipe.eval_step(nets.eval, self.inputs(data, batch))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.timings.warmup_s = (self.timings.warmup_s or 0.0) + time.perf_counter() - start


def named_classes(recipe: Recipe, data: Data, split: Any) -> list[str]:
    """The recipe's class names, else the Dataset's `classes` of `split` (an image folder's folder names, as
    torchvision's ImageFolder has them), in label order; [] where neither names them. A checkpoint keeps
    the training split's (`resume=` and `launch eval` refuse data that names others)."""
    names = [str(c) for c in recipe.class_names]
    if not names and not data.in_memory:
        names = [str(c) for c in getattr(getattr(split, "dataset", None), "classes", None) or ()]
    return names
