"""What a run dir holds, by name, and the one way files in it are written: atomically.

Every file that a reader may open while the run goes on (a checkpoint, results, a failure record,
the metrics after a resume) is written to a temporary name beside it and renamed over the old one,
so nobody ever reads half a file and a crash never leaves one.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import IO

from launcher.errors import ExplainedStop

# The files of a run dir (docs/runs.md, "The run dir").
CONFIG = "config.yaml"  # the resolved config
PLAN = "plan.json"  # strategy, devices, worker environment
LOG = "train.log"  # every line prefixed [launcher] or [rank N]
METRICS = "metrics.jsonl"  # one JSON line per epoch
RESULTS = "results.json"  # the final metrics; a run dir with one holds a finished run
CHECKPOINTS = "checkpoints"
LAST_CHECKPOINT = "last.pt"
# the checkpoint before last.pt (a hard link to its file), kept so that a restart that finds last.pt damaged
# has a whole one to go on from (launcher/train/checkpoint.py)
PREVIOUS_CHECKPOINT = "previous.pt"
FAILURES = "failures"  # one record per failing rank and attempt
TENSORBOARD = "tensorboard"  # TensorBoard event files
CURVES = "curves.png"  # loss and accuracy per epoch
PREEMPTED = "preempted"  # SLURM: the restart count of the job run that asked for its own requeue
SWEEP_OUTPUT = "launch.out"  # a sweep run's console output (local sweeps)
SLURM_RECORD = "slurm.json"
EVAL = "eval.json"  # `launch eval`: accuracy, per class, the confusion matrix
CONFUSION = "confusion.png"
PINNED = ".evaluated-checkpoint"  # `launch eval`, while its workers read: hard links to the checkpoint's files
OUTCOME = "outcome.json"  # how the launch of this run ended: exit code and its one line (host/run_here.py)
CLAIM = ".launch-claim.json"  # which launch owns the dir: pid, host, start, command (host/rundir.py)
NODE = "node.json"  # a launch over several machines: this node's rank, and where rank 0's run dir is
RUN_ID = ".launch-run-id"  # the run's random name, which its checkpoints carry in their seal (integrity.py)
SWEEP_MARK = ".launch-sweep"  # in a sweep dir: its runs are one sweep's (trackers group them: an MLflow parent run)
BEST_INDEX = "best.json"  # checkpoints/: the best epochs kept (checkpoint.keep_best), best first
BEST_CHECKPOINT = "best.pt"  # checkpoints/: the best of them (a hard link to its best-epoch-N.pt)
CSV_METRICS = "metrics.csv"  # log=[csv]: one row per epoch
WORLD_TOKEN = ".launch-world"  # rank 0's mark, by which the other nodes tell whether they see its run dir


def identity(path: Path) -> tuple[int, int, int, int] | None:
    """Which file `path` is now (device, inode, size, modification time); None where there is none. A run
    replaces its checkpoint by renaming a new file over it, so a changed identity means a newer one."""
    try:
        found = path.stat()
    except OSError:
        return None
    return found.st_dev, found.st_ino, found.st_size, found.st_mtime_ns


def last_checkpoint(run_dir: str | Path) -> Path:
    return Path(run_dir) / CHECKPOINTS / LAST_CHECKPOINT


def write_atomic(path: Path, write: Callable[[IO[bytes]], None], durable: bool = False) -> None:
    """Call `write(file)` on a temporary file beside `path`, then rename it to `path`.

    durable: fsync before the rename, so the new contents survive a power loss (checkpoints).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        full = isinstance(exc, Exception) and disk_full(path.parent, exc)  # (before the tmp file frees its space)
        tmp.unlink(missing_ok=True)
        if full:
            raise DiskFull(path) from exc
        raise


FULL_BELOW_BYTES = 1 << 20  # a write that failed with less free than this failed for want of space


def free_bytes(folder: Path) -> int | None:
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return None


def disk_full(folder: Path, exc: BaseException) -> bool:
    """Whether a failed write failed because the disk is full. torch.save does not always say so
    (a zip writer's "unexpected pos" instead of ENOSPC), so a nearly full disk counts too."""
    if _says_disk_full(exc):
        return True
    free = free_bytes(folder)
    return free is not None and free < FULL_BELOW_BYTES


def _says_disk_full(exc: BaseException | None, depth: int = 0) -> bool:
    """ENOSPC or EDQUOT in the exception's chain, or in any rank's failure that torch.distributed.checkpoint
    gathered into a CheckpointException (its `failures`: rank -> (exception, traceback))."""
    while exc is not None and depth < 32:
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        gathered = getattr(exc, "failures", None)
        if isinstance(gathered, dict):
            for failure in gathered.values():
                inner = failure[0] if isinstance(failure, tuple) and failure else failure
                if isinstance(inner, BaseException) and _says_disk_full(inner, depth + 1):
                    return True
        exc, depth = exc.__cause__ or exc.__context__, depth + 1
    return False


class DiskFull(ExplainedStop):
    """No space left on the device of the run dir: the message names the file, the space and the way on."""

    def __init__(self, path: Path, kept: str = "the file it was replacing, if any, is unchanged"):
        self.path = Path(path)
        free = free_bytes(path.parent)
        shown = f"{free / 1e6:.1f} MB free" if free is not None else "no space"
        super().__init__(f"No space left on device: writing {path} failed ({shown} on that file system); free "
                         "some space, or resume the run elsewhere (launch resume=RUN_DIR hydra.run.dir=OTHER_DISK/..."
                         f"); {kept}")


def link_atomic(source: Path, target: Path) -> None:
    """`target` becomes a second name of `source`'s file (a hard link: no copy), replacing what it named,
    atomically: linked under a temporary name beside it, then renamed. Raises OSError where there are no
    hard links (the temporary name is gone then)."""
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    tmp.unlink(missing_ok=True)
    try:
        os.link(source, tmp)
        os.replace(tmp, target)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise


def remove_stale_temporaries(run_dir: Path) -> None:
    """Temporary files of writes whose process is gone (a worker killed mid-write): nobody will rename them."""
    for tmp in Path(run_dir).rglob(".*.tmp-*"):
        pid = tmp.name.rpartition(".tmp-")[2]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            tmp.unlink(missing_ok=True)


def write_text_atomic(path: Path, text: str) -> None:
    write_atomic(path, lambda f: f.write(text.encode()))


def read_json(path: Path) -> dict:
    """A JSON object a run wrote, or {} when it is missing, torn or not an object (a writer killed mid-way),
    or not a regular file (a FIFO would block the reader forever; a folder cannot be read)."""
    import json

    try:
        if not Path(path).is_file():
            return {}
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def read_json_lines(path: Path) -> list[dict]:
    """The JSON objects of a JSON-lines file a run appends to (metrics.jsonl), one a line; a line cut short by
    a stopped writer, or not an object, is left out; [] when it is missing or not a regular file (a FIFO
    would block the reader forever)."""
    import json

    try:
        if not Path(path).is_file():
            return []
        text = Path(path).read_text(errors="replace")
    except OSError:
        return []
    rows = []
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def write_json(path: Path, data: object) -> None:
    import json

    write_text_atomic(path, json.dumps(data, indent=2) + "\n")
