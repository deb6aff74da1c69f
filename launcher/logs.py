"""Logging: one log file per run (`train.log`), every line prefixed with who wrote it.

The launcher writes `[launcher]` lines, each worker `[rank N]` lines, all appending to the same file
(one write per record, so lines never interleave). On the console only rank 0 and the launcher speak;
other ranks print warnings and errors only, so a healthy 8-GPU run reads like a 1-GPU run.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from pathlib import Path
from typing import Any

from launcher.files import LOG

FILE_FORMAT = "%(asctime)s [{who}] %(levelname)s %(name)s: %(message)s"

# Libraries whose chatter the launcher replaces with its own summary (see launcher/host/spawn.py).
QUIET_PREFIXES = ("torch.distributed.elastic", "torch.distributed.launcher", "torch.distributed.run",
                   "torch.multiprocessing")


class _ReaderGone:
    """sys.stdout/sys.stderr that go quiet when their reader has gone (`launch ... | head -1`): the run
    goes on and its log file keeps every line; the console gets no "BrokenPipeError" block per line."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def _silence(self) -> None:
        with contextlib.suppress(OSError, ValueError, AttributeError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self._stream.fileno())  # what is still buffered goes there too
            os.close(devnull)

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._silence()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._silence()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def survive_closed_console() -> None:
    """Wrap sys.stdout and sys.stderr (once) so that a closed pipe silences them instead of raising."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, _ReaderGone):
            setattr(sys, name, _ReaderGone(stream))


# Warnings of one library about another that no user can act on, dropped where they are logged (in the
# launch and in every worker): (logger, words of the message). torchao (imported by transformers' model
# modules, and by perf.precision=fp8) registers two Enums with torch's pytree in a way torch 2.14 deprecates:
# two lines in every rank of every Hugging Face or fp8 run.
FOREIGN_DEPRECATIONS = (("torch.utils._pytree", "register_constant() on Enum subclasses is deprecated"),)


class _DropForeignDeprecation(logging.Filter):
    def __init__(self, words: str) -> None:
        super().__init__()
        self.words = words

    def filter(self, record: logging.LogRecord) -> bool:
        return self.words not in record.getMessage()


def drop_foreign_deprecations() -> None:
    """Put FOREIGN_DEPRECATIONS' filters on their loggers (once: a filter is not added twice)."""
    for name, words in FOREIGN_DEPRECATIONS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropForeignDeprecation) and f.words == words for f in logger.filters):
            logger.addFilter(_DropForeignDeprecation(words))


class _DropLibraryChatter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.name.startswith(QUIET_PREFIXES)


class _FileOnly(logging.Filter):
    """Records logged with extra={"file_only": True} stay out of the console (the launcher summarizes them)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not getattr(record, "file_only", False)


def _reset_root() -> logging.Logger:
    drop_foreign_deprecations()
    root = logging.getLogger()
    for handler in list(root.handlers):
        if getattr(handler, "_launcher", False):
            root.removeHandler(handler)
            handler.close()
    root.setLevel(logging.INFO)
    return root


def _add(root: logging.Logger, handler: logging.Handler, fmt: str, level: int, quiet: bool) -> None:
    handler.setFormatter(logging.Formatter(fmt, datefmt="%H:%M:%S"))
    handler.setLevel(level)
    if quiet:
        handler.addFilter(_DropLibraryChatter())
    if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
        handler.addFilter(_FileOnly())
    handler._launcher = True  # type: ignore[attr-defined]
    root.addHandler(handler)


def setup_launcher_logging(run_dir: Path | None, debug: bool = False) -> None:
    root = _reset_root()
    _add(root, logging.StreamHandler(sys.stdout), "launch: %(message)s", logging.INFO, quiet=not debug)
    if run_dir is not None:
        _add(root, logging.FileHandler(run_dir / LOG), FILE_FORMAT.format(who="launcher"),
             logging.DEBUG if debug else logging.INFO, quiet=not debug)


def setup_worker_logging(run_dir: Path, rank: int) -> None:
    root = _reset_root()
    if rank == 0:
        _add(root, logging.StreamHandler(sys.stdout), "%(message)s", logging.INFO, quiet=True)
    else:
        _add(root, logging.StreamHandler(sys.stderr), f"[rank {rank}] %(levelname)s %(message)s", logging.WARNING,
             quiet=True)
    _add(root, logging.FileHandler(run_dir / LOG), FILE_FORMAT.format(who=f"rank {rank}"), logging.INFO,
         quiet=True)
