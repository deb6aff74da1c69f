"""The best epochs' checkpoints beside last.pt (`checkpoint.keep_best=3 checkpoint.metric=test_acc`).

    checkpoints/last.pt                  every epoch (as ever)
    checkpoints/best-epoch-0007.pt       the best `keep_best` epochs by the metric, each a second name (a hard
    checkpoints/best.pt                  link) of that epoch's last.pt: no copy; best.pt is the best of them
    checkpoints/best.json                the kept ones, best first: epoch, figure, file (and shard folder)

`launch eval RUN_DIR best` and `launch export RUN_DIR best` read best.pt. Each file appears whole (linked
under a temporary name, then renamed), and at every moment every file best.json names exists and best.pt
is one of them (`_publish` says in which order); a restart finishes what a process that died left half
done. A sharded checkpoint (fsdp: last.pt names its torch.distributed.checkpoint folder) keeps its folder
as long as a best file names it (checkpoint.save_sharded asks `kept_folders`). Which epochs are kept is
decided on the training thread (`ranks`); the files are made on the checkpoint writer's thread once that
epoch's last.pt is on disk (`keep`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from launcher.files import BEST_CHECKPOINT, BEST_INDEX, link_atomic, read_json, write_atomic, write_json
from launcher.train.early_stop import is_better

log = logging.getLogger("launcher.train")


def kept_folders(folder: Path) -> set[str]:
    """The shard folders the best checkpoints in `folder` (a run's checkpoints/) name."""
    return {str(e["shards"]) for e in read_json(folder / BEST_INDEX).get("kept", []) if e.get("shards")}


class BestCheckpoints:
    def __init__(self, folder: Path, keep: int, key: str, minimize: bool):
        self.folder = Path(folder)
        self.keep_count = keep
        self.key = key
        self.minimize = minimize
        index = read_json(self.folder / BEST_INDEX)
        same = index.get("metric") == key and index.get("minimize") == minimize
        # (a restart in this run dir: the kept ones still count; files that went missing do not)
        self.kept: list[dict[str, Any]] = [e for e in index.get("kept", []) if (self.folder / e["file"]).is_file()] \
            if same else []
        if self.kept:  # (and what a process that died while keeping them left half done is finished)
            self._publish(self.kept)

    def ranks(self, epoch: int, value: Any) -> bool:
        """Whether `epoch`, with figure `value`, is among the best `keep` so far (an equal value does not
        displace an earlier epoch)."""
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            return False
        if len(self.kept) < self.keep_count:
            return is_better(float(value), None, self.minimize)
        worst = self.kept[-1]["value"]
        return is_better(float(value), worst, self.minimize)

    def keep(self, epoch: int, value: float, last: Path, shards: str | None) -> None:
        """Make `last` (this epoch's checkpoint, whole on disk) one of the best; drop what falls out."""
        name = f"best-epoch-{epoch:04d}.pt"
        _link(last, self.folder / name)
        entry = {"epoch": epoch, "value": float(value), "file": name, "shards": shards}
        self._publish([e for e in self.kept if e["epoch"] != epoch] + [entry])
        if self.kept[0]["epoch"] == epoch:  # (said when best.pt changes)
            log.info("best.pt: epoch %d (%s %.4g, %s is better; kept: %s)", epoch, self.key, value,
                     "lower" if self.minimize else "higher", ", ".join(f"epoch {e['epoch']}" for e in self.kept))

    def _publish(self, entries: list[dict[str, Any]]) -> None:
        """best.json and best.pt for `entries` (each one's file on disk): the best `keep` of them named, best.pt
        the best, what drops out (and any best-epoch file nothing names: a process that died mid-way) removed.

        Ordered so that at every moment every file best.json names exists and best.pt is one of them: best.json
        first names them all (the new file before best.pt may become it, a file that drops out until best.pt
        is no longer it), then best.pt is linked, then best.json names the kept ones, then the rest goes."""
        ranked = sorted(entries, key=lambda e: (e["value"] if self.minimize else -e["value"], e["epoch"]))
        kept = ranked[:self.keep_count]
        self._write_index(ranked)
        _link(self.folder / kept[0]["file"], self.folder / BEST_CHECKPOINT)
        if len(ranked) > len(kept):
            self._write_index(kept)
        self.kept = kept
        named = {e["file"] for e in kept}
        for path in self.folder.glob("best-epoch-*.pt"):
            if path.name not in named:
                path.unlink(missing_ok=True)

    def _write_index(self, entries: list[dict[str, Any]]) -> None:
        write_json(self.folder / BEST_INDEX, {"metric": self.key, "minimize": self.minimize, "kept": entries})


def _link(source: Path, target: Path) -> None:
    """`target` becomes a second name of `source`'s file, atomically; a copy where there are no hard links."""
    try:
        link_atomic(source, target)
    except OSError:
        import shutil

        with open(source, "rb") as whole:
            write_atomic(target, lambda f: shutil.copyfileobj(whole, f, 1 << 24), durable=True)
