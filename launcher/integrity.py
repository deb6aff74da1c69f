"""What proves a checkpoint whole and whose it is, written with it and checked when a user names it.

A checkpoint (checkpoints/last.pt) carries `SEAL`: the SHA-256 of everything else in it (every tensor's
dtype, shape and bytes, every other value, by its place in the nesting), the run it belongs to and its
epoch; a sharded one also the SHA-256 of each file of its torch.distributed.checkpoint folder. torch's
loader checks none of this (bytes zeroed inside a tensor load as zeros), so `launch resume=`, `launch
eval` and `launch export` check it (host/resume.py `load_checkpoint`) before any worker starts.

The run: each run dir holds `RUN_ID`, a random name made the first time a checkpoint is written there. A
checkpoint found in a run dir whose name is not the one it carries was copied in from another run.
Checkpoints written before this existed carry no seal and load as before.

Leaf module: imports torch only inside the functions that hash tensors (the host wing calls them only
when it reads a checkpoint, which imports torch anyway).
"""

from __future__ import annotations

import hashlib
import os
import secrets
from pathlib import Path
from typing import Any

from launcher.files import RUN_ID

SEAL = "seal"  # the checkpoint's entry: {"sha256", "run", "epoch"[, "files"]}
FILE_CHUNK = 1 << 24  # bytes read at a time when a file is hashed


def run_id(run_dir: Path, create: bool = False) -> str | None:
    """The run's name from `run_dir`/RUN_ID; with `create`, made (exclusively) where there is none yet.
    None: no name there (a run from before, or a folder that is not a run dir)."""
    path = Path(run_dir) / RUN_ID
    try:
        return path.read_text().strip() or None
    except FileNotFoundError:
        if not create:
            return None
    except OSError:
        return None
    name = secrets.token_hex(8)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:  # (made this instant by another writer: theirs stands)
        return run_id(run_dir)
    except OSError:  # (a full or read-only disk: the checkpoint's own write says so in one line)
        return None
    try:
        with os.fdopen(fd, "w") as f:
            f.write(name + "\n")
    except OSError:
        return None
    return name


PIECE_BYTES = 1 << 25  # tensors are hashed in pieces of this size, on several threads at once
HASH_THREADS = 4  # (hashlib releases the GIL on large buffers: the pieces hash in parallel)


def state_digest(state: dict[str, Any]) -> str:
    """SHA-256 of a checkpoint's contents (its seal's run, epoch and files included): each value by its
    path in the nesting, tensors by dtype, shape and the SHA-256 of each 32 MB piece of their raw bytes
    (read where they lie: memory-mapped ones are read once, not copied). The pieces are hashed on
    HASH_THREADS threads: on 2 cores a 1 GB checkpoint's digest took 0.6 s on one thread."""
    from concurrent.futures import ThreadPoolExecutor

    import torch

    parts: list[bytes | memoryview] = []  # in order: descriptions (bytes) and tensor pieces (memoryview)

    def walk(obj: Any, path: str) -> None:
        if isinstance(obj, torch.Tensor):
            t = obj.detach()
            parts.append(f"{path}\0T\0{t.dtype}\0{tuple(t.shape)}\n".encode())
            if t.numel():
                raw = memoryview(t.cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
                parts.extend(raw[i:i + PIECE_BYTES] for i in range(0, len(raw), PIECE_BYTES))
        elif isinstance(obj, dict):
            parts.append(f"{path}\0D{len(obj)}\n".encode())
            for key, value in obj.items():
                if path == "" and key == SEAL and isinstance(value, dict):  # (all of it but its own digest)
                    value = {k: v for k, v in value.items() if k != "sha256"}
                walk(value, f"{path}/{key!r}")
        elif isinstance(obj, (list, tuple)):
            parts.append(f"{path}\0{type(obj).__name__[0]}{len(obj)}\n".encode())
            for i, value in enumerate(obj):
                walk(value, f"{path}/{i}")
        else:
            parts.append(f"{path}\0{type(obj).__name__}\0{obj!r}\n".encode())

    walk(state, "")
    pieces = [p for p in parts if isinstance(p, memoryview)]
    with ThreadPoolExecutor(max_workers=max(1, min(HASH_THREADS, len(pieces)))) as pool:
        digests = iter(pool.map(lambda piece: hashlib.sha256(piece).digest(), pieces))
        h = hashlib.sha256()
        for part in parts:
            h.update(next(digests) if isinstance(part, memoryview) else part)
    return h.hexdigest()


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(FILE_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def folder_digests(folder: Path) -> dict[str, str]:
    """Each regular file of a checkpoint's folder (a DCP folder: its shards and .metadata) by name."""
    return {p.name: file_digest(p) for p in sorted(Path(folder).iterdir()) if p.is_file()}


def seal(state: dict[str, Any], run: str | None, folder: Path | None = None) -> dict[str, Any]:
    """`state` with its seal added (the digest is taken last: nothing is added after it)."""
    mark: dict[str, Any] = {"run": run, "epoch": state.get("epoch")}
    if folder is not None:
        mark["files"] = folder_digests(folder)
    state[SEAL] = mark
    mark["sha256"] = state_digest(state)
    return state


def broken_seal(state: dict[str, Any], path: Path) -> str | None:
    """What is wrong with the checkpoint `state`, read from `path`, against its seal: changed contents, a
    changed or missing file of its folder, or another run's checkpoint in this run dir. None: whole (or
    written before seals existed)."""
    mark = state.get(SEAL)
    if mark is None:
        return None
    if not isinstance(mark, dict) or not isinstance(mark.get("sha256"), str):
        return f"its seal is {str(mark)[:80]!r}, not one launch writes"
    if state_digest(state) != mark["sha256"]:
        return ("its contents differ from the digest written with it (bytes changed or damaged after it was "
                "saved)")
    files = mark.get("files")
    if isinstance(files, dict) and isinstance(state.get("sharded"), str):
        folder = path.parent / state["sharded"]
        for name, digest in sorted(files.items()):
            file = folder / str(name)
            if not file.is_file():
                return f"its shard file {file} is missing"
            if file_digest(file) != digest:
                return f"its shard file {file} differs from the digest written with it (changed or damaged)"
    if path.parent.name == "checkpoints":
        here = run_id(path.parent.parent)
        if here is not None and mark.get("run") not in (None, here):
            return (f"it belongs to another run (run {mark.get('run')}, epoch {mark.get('epoch')}), not to "
                    f"{path.parent.parent} (run {here}): it was copied in from elsewhere")
    return None
