"""What a run leaves behind for people and tools: metrics.jsonl (one JSON line per epoch) and results.json."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from launcher.files import METRICS, RESULTS, write_text_atomic


def _clean(value: Any) -> Any:
    # JSON has no NaN/inf; write null so every line stays valid JSON for jq, pandas and friends.
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsLog:
    """metrics.jsonl of a run dir. Only rank 0 writes it."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / METRICS

    def rewrite(self, rows: list[dict[str, Any]]) -> None:
        """Replace the file with `rows` (on resume: the history the checkpoint carries, no duplicates)."""
        write_text_atomic(self.path, "".join(json.dumps({k: _clean(v) for k, v in r.items()}) + "\n" for r in rows))

    def append(self, row: dict[str, Any]) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps({k: _clean(v) for k, v in row.items()}) + "\n")


def write_results(run_dir: Path, results: dict[str, Any]) -> None:
    write_text_atomic(Path(run_dir) / RESULTS, json.dumps({k: _clean(v) for k, v in results.items()}, indent=2) + "\n")
