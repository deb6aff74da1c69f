"""Checkpoints: written atomically every epoch, read back with weights_only=True.

Layout of a checkpoint (a plain dict, so `torch.load(..., weights_only=True)` reads it):
    net_state_dict                  the model's weights and buffers
    optimizer_state_dicts, scheduler_state_dicts   one per optimizer (two under recipe.optimizer=muon)
    epoch          epochs completed
    history        the per-epoch metrics so far (metrics.jsonl is rewritten from it on resume)
    rng            torch CPU and CUDA generator states
    config         the resolved config of the run that wrote it
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from launcher.config import LaunchError

LAST = "last.pt"


def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def save_atomic(state: dict[str, Any], path: Path) -> None:
    """Write to a temporary file beside `path`, then rename: a crash never leaves a half-written checkpoint."""
    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load(path: str | Path, map_location: Any = "cpu") -> dict[str, Any]:
    import torch

    return torch.load(path, map_location=map_location, weights_only=True)


def resolve_resume(value: str, search_root: Path = Path("outputs")) -> Path:
    """`resume` -> the checkpoint file: a .pt file, a run dir holding checkpoints/last.pt, or `latest`."""
    if value == "latest":
        candidates = sorted(search_root.glob(f"**/checkpoints/{LAST}"), key=lambda p: p.stat().st_mtime)
        if not candidates:
            raise LaunchError(f"resume=latest is not valid: no checkpoint under {search_root.resolve()}/ "
                              "(e.g. launch resume=outputs/DATE/TIME-RECIPE-ID)")
        return candidates[-1]
    path = Path(os.path.expanduser(value))
    if path.is_dir():
        path = checkpoint_dir(path) / LAST
    if not path.is_file():
        raise LaunchError(f"resume={value} is not valid: {path} does not exist; give a run dir that holds "
                          "checkpoints/last.pt, a .pt file, or latest (e.g. launch resume=latest)")
    return path


def optimizer_states(state: dict[str, Any]) -> tuple[list[dict], list[dict]]:
    """(optimizer states, scheduler states), also from checkpoints written with one optimizer (launcher 0.1)."""
    if "optimizer_state_dicts" in state:
        return list(state["optimizer_state_dicts"]), list(state["scheduler_state_dicts"])
    return [state["optimizer_state_dict"]], [state["scheduler_state_dict"]]
