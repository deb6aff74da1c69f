"""Early stopping (`early_stop.metric=test_loss early_stop.patience=3`) and the figure a run is judged by.

The decision is a function of the epochs' history alone (each row's figures are sums over every rank,
read alike by all: launcher/train/epoch_end.py `EpochEnds.conclude`), so every rank stops after the same
epoch, and a restarted or resumed run, which carries its history, decides as the uninterrupted one would.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from launcher.config import DEFAULT_OBJECTIVE, Config, figure_key, smaller_is_better
from launcher.figures import row_figures, unknown


def held_out(row: dict[str, Any]) -> list[str]:
    """The held-out figures of an epoch row (test_NAME), in order."""
    return [k for k, v in row.items() if k.startswith("test_") and isinstance(v, (int, float))
            and not isinstance(v, bool)]


def default_figure(row: dict[str, Any]) -> str | None:
    """The figure a run is judged by when none is named: test_acc, else the first held-out figure."""
    named = held_out(row)
    return DEFAULT_OBJECTIVE if DEFAULT_OBJECTIVE in named else (named[0] if named else None)


def check_named(key: str, typed: str, setting: str, row: dict[str, Any]) -> None:
    """`key` (typed as `typed` in `setting`) is a figure of this evaluated epoch's row, else one line."""
    if key not in row:
        raise unknown(setting, typed, key, row_figures(row))


def is_better(value: float, best: float | None, minimize: bool, delta: float = 0.0) -> bool:
    if not math.isfinite(value):
        return False
    if best is None:
        return True
    return value < best - delta if minimize else value > best + delta


@dataclass
class EarlyStop:
    key: str
    typed: str
    minimize: bool
    patience: int
    min_delta: float

    @classmethod
    def from_config(cls, cfg: Config) -> EarlyStop | None:
        section = cfg.early_stop
        if section.metric is None:
            return None
        key = figure_key(section.metric)
        return cls(key, str(section.metric), smaller_is_better(key, section.mode), section.patience,
                   float(section.min_delta))

    def judge(self, history: list[dict[str, Any]]) -> dict[str, Any] | None:
        """Whether to stop after the last epoch of `history`: None, or what results.json says of it. Only an
        epoch that has the figure counts (with eval.every=N, a held-out one every N epochs)."""
        last = history[-1]
        if self.key.startswith("test_") and not held_out(last):
            return None  # (no evaluation after this epoch)
        check_named(self.key, self.typed, "early_stop.metric", last)
        best = best_epoch = None
        waited = 0
        for row in history:
            value = row.get(self.key)
            if not isinstance(value, (int, float)):
                continue
            if is_better(float(value), best, self.minimize, self.min_delta):
                best, best_epoch, waited = float(value), int(row["epoch"]), 0
            else:
                waited += 1
        if waited < self.patience:
            return None
        way = "fallen" if self.minimize else "risen"
        by = f" by more than {self.min_delta:g}" if self.min_delta else ""
        shown = f"{best:.4g} at epoch {best_epoch}" if best is not None else "none finite"
        reason = (f"{self.key} has not {way}{by} in {waited} evaluations (early_stop.patience={self.patience}; "
                  f"best {shown})")
        return {"epoch": int(last["epoch"]), "metric": self.key, "best": best, "best_epoch": best_epoch,
                "reason": reason}
