"""`resume=`: which checkpoint, whether it is a launch checkpoint at all, and what this launch changes
of the run it continues. Checked in the launcher, before any worker starts.

The rule (README "Resuming"): a resume continues the training *state* the checkpoint holds (weights,
optimizer moments, the RNG, the metrics so far, and the position in the schedule: the epochs done)
and takes every *setting* from this command line: lr, the optimizer's hyper-parameters (momentum,
weight decay, ...), epochs (the schedule is laid over the new total and continues at the epoch
reached), batch size, seed, gpus, strategy, precision. What changed is logged and written to the new
run's plan.json (`resume.changed`), and config.yaml records the values used.

What the state cannot carry over is refused in one line: a file that is not a launch checkpoint;
another recipe, model or optimizer (recipe.name, recipe.model, optim); epochs not above the epochs
already trained (evaluate it instead: `launch eval RUN_DIR`). A network of another shape (a recipe
hyper-parameter that changes a layer) only shows when a worker loads the weights: one line too.
"""

from __future__ import annotations

import os
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from launcher.config import Config, choices, saved_choices, to_plain
from launcher.errors import LaunchError
from launcher.files import CHECKPOINTS, LAST_CHECKPOINT, last_checkpoint

# Settings a resumed run may differ in without it meaning anything for the training (not reported).
_NOT_SETTINGS = {"resume", "dry_run", "progress", "tensorboard", "profile", "fault"}


@dataclass(frozen=True)
class Resume:
    path: Path  # the checkpoint file
    epoch: int  # epochs it has trained
    changed: dict[str, tuple[Any, Any]] = field(default_factory=dict)  # key -> (checkpoint's, this launch's)

    def record(self) -> dict[str, Any]:
        return {"from": str(self.path), "epoch": self.epoch,
                "changed": {k: list(v) for k, v in self.changed.items()}}

    def describe(self) -> str:
        if not self.changed:
            return f"resuming {self.path} after epoch {self.epoch}, every setting as it was"
        shown = ", ".join(f"{k} {old} -> {new}" for k, (old, new) in self.changed.items())
        return f"resuming {self.path} after epoch {self.epoch}; from this command line: {shown}"


def resolve(value: str, search_root: Path = Path("outputs"), setting: str = "resume") -> Path:
    """`resume` (or `setting`) -> the checkpoint file: a .pt file, a run dir holding checkpoints/last.pt,
    or `latest` (the newest under outputs/). `setting` is a key (resume) or a command (`launch eval`),
    which the messages spell as typed: resume=VALUE, launch eval VALUE."""

    def typed(v: str) -> str:
        return f"{setting} {v}" if " " in setting else f"{setting}={v}"

    def example(v: str) -> str:
        return typed(v) if setting.startswith("launch ") else f"launch {typed(v)}"

    if value == "latest":
        candidates = sorted(search_root.glob(f"**/{CHECKPOINTS}/{LAST_CHECKPOINT}"), key=lambda p: p.stat().st_mtime)
        if not candidates:
            raise LaunchError(f"{typed('latest')} is not valid: no checkpoint under {search_root.resolve()}/ "
                              f"(e.g. {example('outputs/DATE/TIME-RECIPE-ID')})")
        return candidates[-1]
    path = Path(os.path.expanduser(value))
    if path.is_dir():
        path = last_checkpoint(path)
    if not path.is_file():
        raise LaunchError(f"{typed(value)} is not valid: {path} does not exist; give a run dir that holds "
                          f"checkpoints/last.pt, a .pt file, or latest (e.g. {example('latest')})")
    return path


def load_checkpoint(path: Path, setting: str) -> dict[str, Any]:
    """A launch checkpoint read with weights_only=True (tensors memory-mapped, not read), or one line
    saying what the file is instead."""
    import pickle

    import torch

    def refuse(what: str) -> LaunchError:
        return LaunchError(f"{setting} is not valid: {path} is not a launch checkpoint ({what}); give the run "
                           f"dir of a launch run, or its checkpoints/last.pt")

    if path.stat().st_size == 0:
        raise refuse("the file is empty")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, zipfile.BadZipFile, OSError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if "central directory" in first or isinstance(exc, EOFError):
            what = "truncated, or not written by torch.save"
        elif isinstance(exc, pickle.UnpicklingError):
            what = "not written by torch.save, or it holds objects that weights_only=True does not load"
        else:
            what = f"it does not load with weights_only=True: {first[:160]}"
        raise refuse(what) from None
    if isinstance(state, torch.Tensor):
        raise refuse("it holds a single tensor")
    if not isinstance(state, dict):
        raise refuse(f"it holds a {type(state).__name__}")
    if ("net_state_dict" not in state and "sharded" not in state) or "epoch" not in state:
        tensors = sum(isinstance(v, torch.Tensor) for v in state.values())
        what = ("a plain state_dict: weights only, no optimizer, epoch or config" if tensors and tensors == len(state)
                else f"a dict without net_state_dict and epoch (keys: {', '.join(map(str, list(state)[:5]))})")
        raise refuse(what)
    return state


def inspect(value: str, cfg: Config, search_root: Path = Path("outputs")) -> Resume:
    """The checkpoint `resume=value` names, checked against this launch's config (a LaunchError if it
    cannot continue under it)."""
    path = resolve(value, search_root).resolve()
    state = load_checkpoint(path, f"resume={value}")
    epoch = int(state["epoch"])
    now = choices(cfg)
    for key, saved in saved_choices(state.get("config") or {}).items():
        if saved not in (None, now[key]):
            raise LaunchError(f"{key}={now[key]} is not valid with resume={value}: the checkpoint was trained with "
                              f"{key}={saved}, and its weights and optimizer state only continue under it (e.g. "
                              f"launch {key}={saved} resume={value})")
    from launcher.strategies import STRATEGIES

    strategy = STRATEGIES.get(type(cfg.strategy))
    if strategy is not None and strategy.sharded and "sharded" not in state:
        raise LaunchError(f"strategy={cfg.strategy.name} is not valid with resume={value}: a checkpoint of an "
                          "unsharded run resumes under the strategy that wrote it (sharded runs' checkpoints resume "
                          f"under any), e.g. launch strategy=ddp resume={value}")
    if cfg.epochs <= epoch:
        raise LaunchError(f"epochs={cfg.epochs} is not valid with resume={value}: the checkpoint has trained {epoch} "
                          f"epoch{'s' if epoch != 1 else ''} already; give more (e.g. launch resume={value} "
                          f"epochs={epoch + max(1, epoch)}), or evaluate it: launch eval {value}")
    changed = _differences(_flat(state.get("config") or {}), _flat(to_plain(cfg)))
    return Resume(path, epoch, changed)


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for key, value in tree.items():
            out.update(_flat(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: tree}


def _differences(saved: dict[str, Any], now: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    if not saved:
        return {}
    return {k: (saved.get(k), v) for k, v in now.items()
            if k.split(".")[0] not in _NOT_SETTINGS and k not in _NOT_SETTINGS and k in saved and saved[k] != v}
