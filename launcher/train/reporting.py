"""What rank 0 leaves for people to look at: TensorBoard scalars every epoch, a curves PNG at the end.

    tensorboard --logdir <run dir>       # loss, accuracy, lr, img/s, GPU memory, input wait per epoch

TensorBoard goes through torch.utils.tensorboard into `<run dir>/tensorboard/` (one of the trackers
`log=[...]` picks, the default; the others are in launcher/train/trackers.py); the forkserver imports it
(launcher/train/preload.py) and the trainer opens the writer on a thread of its own while the run warms
up (launcher/train/loop.py), so neither the start-up nor the first epoch waits for it. `curves.png` is
drawn from the epoch history with matplotlib, so a run that is resumed draws its whole history.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

from launcher.files import TENSORBOARD, write_atomic

# metrics.jsonl key -> TensorBoard tag
SCALARS = {
    "loss": "train/loss", "train_acc": "train/accuracy", "test_loss": "test/loss", "test_acc": "test/accuracy",
    "lr": "train/lr", "img_per_s": "speed/img_per_s", "images_per_s": "speed/img_per_s",
    "tokens_per_s": "speed/tokens_per_s",
    "input_stall": "speed/input_wait_fraction", "bpb": "train/bits_per_byte", "test_bpb": "test/bits_per_byte",
    "mfu": "speed/mfu",
    "max_mem_allocated_mb": "gpu/max_memory_allocated_mb", "max_mem_reserved_mb": "gpu/max_memory_reserved_mb",
}


def figure_tag(key: str) -> str | None:
    """A recipe's own figure (train_NAME, test_NAME) as TensorBoard's tag: train/NAME, test/NAME."""
    for prefix in ("train_", "test_"):
        if key.startswith(prefix) and key != "train_s":
            return f"{prefix[:-1]}/{key[len(prefix):]}"
    return None


class TensorBoardLog:
    def __init__(self, run_dir: Path, enabled: bool, folder: str | None = None):
        self.folder = Path(run_dir) / (folder or TENSORBOARD)
        self.enabled = enabled
        self._writer = None

    def open(self) -> None:
        """Import TensorBoard (unless the forkserver did) and open the event file, once."""
        if not self.enabled or self._writer is not None:
            return
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:  # tensorboard is a dependency, but an environment may lack it
            logging.getLogger("launcher.train").warning("no TensorBoard logs: %s (pip install tensorboard)", exc)
            self.enabled = False
            return
        self._writer = SummaryWriter(log_dir=str(self.folder))

    def epoch(self, row: dict[str, Any]) -> None:
        self.open()
        if not self.enabled:
            return
        for key, value in row.items():
            tag = SCALARS.get(key) or figure_tag(key)
            if tag and isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                self._writer.add_scalar(tag, value, global_step=row["epoch"])
        self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def plot_curves(history: list[dict[str, Any]], path: Path) -> Path | None:
    """Loss and accuracy per epoch (train, and test where evaluated) as a PNG; None with no epochs. Written
    atomically: a write that fails (a full disk) leaves no partial or empty file."""
    if not history:
        return None
    fig = curves_figure(history)
    fig.subplots_adjust(left=0.07, right=0.98, bottom=0.13, top=0.92, wspace=0.2)  # (fixed: tight_layout's
    # measuring of every label took as long as drawing them)
    write_atomic(path, lambda f: fig.savefig(f, format="png", dpi=100))
    return path


def curves_figure(history: list[dict[str, Any]]):
    """plot_curves' figure: the loss (a log axis where it spans more than 10x) and the accuracy or the
    recipe's own figures, by epoch."""
    epochs = [r["epoch"] for r in history]
    fig = _figure((10, 4))
    ax_loss, ax_acc = fig.subplots(1, 2)
    ax_loss.plot(epochs, [r["loss"] for r in history], "o-", label="train")
    tested = [r for r in history if "test_loss" in r]
    if tested:
        ax_loss.plot([r["epoch"] for r in tested], [r["test_loss"] for r in tested], "s-", label="test")
    # the right panel: accuracy where the recipe has it, else the recipe's own figures
    if any("train_acc" in r or "test_acc" in r for r in history):
        figures, title = {"train_acc": "train", "test_acc": "test"}, "accuracy (%)"
        scale = 100.0
    else:
        names = [k for k in history[-1] if k.startswith(("train_", "test_")) and k not in ("train_s", "test_loss")]
        figures, title, scale = {k: k for k in names}, "figures", 1.0
    for key, label in figures.items():
        have = [r for r in history if isinstance(r.get(key), (int, float))]
        if have:
            ax_acc.plot([r["epoch"] for r in have], [scale * r[key] for r in have], "o-", label=label)
    losses = [v for r in history for v in (r.get("loss"), r.get("test_loss")) if isinstance(v, (int, float))]
    if losses and min(losses) > 0 and max(losses) > 10 * min(losses):
        ax_loss.set_yscale("log")  # (a loss that falls by orders of magnitude: on a linear axis all but the
        # first epochs lay flat on the floor)
    for ax, name in ((ax_loss, "loss"), (ax_acc, title)):
        ax.set_title(name)
        ax.set_xlabel("epoch")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    return fig


def _figure(size: tuple[float, float]):
    """A matplotlib Figure drawn by the Agg renderer, without pyplot: no process-wide figure registry to
    close, nothing shared between the threads that plot, and pyplot's own import and backend selection
    are not paid at a run's end."""
    from matplotlib.figure import Figure

    return Figure(figsize=size)


def plot_confusion(confusion: list[list[int]], names: list[str], path: Path) -> Path:
    """The confusion matrix (rows: true class, columns: predicted), each row as fractions of that class."""
    n = len(confusion)
    fractions = [[v / max(1, sum(row)) for v in row] for row in confusion]
    size = max(4.0, 0.45 * n + 2)
    fig = _figure((size, size * 0.9))
    ax = fig.subplots()
    image = ax.imshow(fractions, cmap="Blues", vmin=0, vmax=1)
    ax.set_xticks(range(n), names, rotation=45, ha="right")
    ax.set_yticks(range(n), names)
    ax.set_xlabel("predicted")
    ax.set_ylabel("true class")
    if n <= 20:
        for i in range(n):
            for j in range(n):
                if confusion[i][j]:
                    ax.text(j, i, str(confusion[i][j]), ha="center", va="center", fontsize=7,
                            color="white" if fractions[i][j] > 0.5 else "black")
    fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04, label="fraction of the true class")
    total = sum(map(sum, confusion))
    correct = sum(confusion[i][i] for i in range(n))
    ax.set_title(f"accuracy {100 * correct / max(1, total):.2f}% on {total} test images")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def counted(model: Any) -> str:
    """A model's parameters (a tied one once), as a user reads a model's size: 124.48M, 8.03B."""
    n = sum(p.numel() for p in model.parameters())
    for size, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)
