"""Which rank failed first, and why: the root cause, not the wall of secondary errors it sets off.

When one rank dies, its peers fail too (gloo "Connection closed by peer", NCCL aborts, timeouts). Each
worker that fails writes a record here with a high-resolution time and whether its error looks like
such an echo; the launcher then names the earliest primary failure and shows its traceback alone.
"""

from __future__ import annotations

import json
import re
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from launcher.errors import ExplainedStop
from launcher.files import FAILURES, NODE, read_json, write_text_atomic

# Errors that mean "a peer went away" rather than "this rank is broken".
_ECHO_TYPES = ("DistBackendError", "DistNetworkError", "DistStoreError", "DistError")
_ECHO_PHRASES = ("connection closed by peer", "connection reset by peer", "broken pipe", "socket timeout",
                 "nccl communicator was aborted", "watchdog caught collective operation timeout",
                 "process group watchdog", "gloo", "timed out", "connection refused",
                 "timeout caused pair closure")  # gloo, when its peer stops answering


@dataclass
class FailureRecord:
    rank: int
    attempt: int
    time: float
    exc_type: str
    message: str
    traceback: str
    secondary: bool
    exit_code: int
    explained: bool = False  # an ExplainedStop: its message says what happened and what to do

    @property
    def headline(self) -> str:
        first = self.message.strip().splitlines()[0] if self.message.strip() else ""
        return f"{self.exc_type}: {first}" if first else self.exc_type


def span(ranks: list[int]) -> str:
    """Ranks as a person reads them: [2, 3] -> '2-3'; [1, 4] -> '1, 4' (sorted first)."""
    ranks = sorted(ranks)
    if len(ranks) > 1 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ", ".join(map(str, ranks))


def short_headline(headline: str, limit: int = 160) -> str:
    """gloo/NCCL messages start with a source location and end with advice; keep the middle."""
    text = re.sub(r"\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", headline)
    text = text.split(". This is typically")[0]
    return text if len(text) <= limit else text[: limit - 1] + "…"


def reads_secondary(line: str) -> bool:
    """`looks_secondary` for an error known only as text, "TypeName: message" (a script's traceback's last line)."""
    kind, _, message = line.partition(":")
    if kind.strip().rsplit(".", 1)[-1] in _ECHO_TYPES:
        return True
    return kind.strip().endswith("RuntimeError") and any(p in message.lower() for p in _ECHO_PHRASES)


def looks_secondary(exc: BaseException) -> bool:
    if type(exc).__name__ in _ECHO_TYPES:
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(p in text for p in _ECHO_PHRASES)


def write_record(run_dir: Path, rank: int, attempt: int, exc: BaseException, exit_code: int) -> None:
    folder = Path(run_dir) / FAILURES
    record = {
        "rank": rank, "attempt": attempt, "time": time.time(), "exc_type": type(exc).__name__,
        "message": str(exc), "traceback": "".join(traceback.format_exception(exc)),
        "secondary": looks_secondary(exc), "exit_code": exit_code, "explained": isinstance(exc, ExplainedStop),
    }
    write_text_atomic(folder / f"attempt{attempt}-rank{rank}.json", json.dumps(record, indent=1))


def read_records(run_dir: Path, also: Path | None = None) -> list[FailureRecord]:
    """The records in `run_dir` (and in `also`: rank 0's run dir, for a node of a launch over several
    machines that shares it), one per rank and attempt."""
    found: dict[str, FailureRecord] = {}
    for folder in (Path(run_dir) / FAILURES, *((Path(also) / FAILURES,) if also else ())):
        if not folder.is_dir():
            continue
        for path in folder.glob("attempt*-rank*.json"):
            try:
                found.setdefault(path.name, FailureRecord(**json.loads(path.read_text())))
            except (OSError, ValueError, TypeError):
                continue
    return list(found.values())


def main_run_dir(run_dir: Path) -> Path | None:
    """Rank 0's run dir, when this run dir is another node's of a launch over several machines and the
    nodes share rank 0's (files.NODE, written by that node's first worker)."""
    node = read_json(Path(run_dir) / NODE)
    main = node.get("main_run_dir") if node and node.get("shared") else None
    return Path(main) if main and Path(main) != Path(run_dir) else None


def root_cause(records: list[FailureRecord]) -> FailureRecord | None:
    """The earliest primary failure of the last attempt; the earliest failure if all look secondary."""
    if not records:
        return None
    last = max(r.attempt for r in records)
    latest = [r for r in records if r.attempt == last]
    primary = [r for r in latest if not r.secondary]
    return min(primary or latest, key=lambda r: r.time)
