"""What proves a checkpoint whole and whose it is, written with it and checked when a user names it.

A checkpoint (checkpoints/last.pt) carries `SEAL`: the SHA-256 of everything else in it (every tensor's
dtype, shape and bytes, every other value, by its place in the nesting), the run it belongs to and its
epoch; a sharded one also the SHA-256 of each file of its torch.distributed.checkpoint folder. torch's
loader checks none of this (bytes zeroed inside a tensor load as zeros), so `launch resume=`, `launch
eval` and `launch export` check it (host/resume.py `load_checkpoint`) before any worker starts.

The run: each run dir holds `RUN_ID`, a random name made the first time a checkpoint is written there. A
checkpoint found in a run dir whose name is not the one it carries was copied in from another run.
Checkpoints written before this existed carry no seal and load as before.

Whose it is: a digest anyone can recompute, so it proves a checkpoint whole, never where it came from. The
seal also carries `MAC`, an HMAC-SHA256 of its digest, run and epoch under this user's secret key
(`key_path`: made on first use, mode 0600). Only a run of this user's (on this machine, or a cluster that
shares the home) can make it: `unproven` says whether a checkpoint's seal proves that, which is what lets
its saved config name code that launch imports or calls (launcher/host/consent.py).

Leaf module: imports torch only inside the functions that hash tensors (the host wing calls them only
when it reads a checkpoint, which imports torch anyway).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import tempfile
from pathlib import Path
from typing import Any

from launcher.files import RUN_ID

SEAL = "seal"  # the checkpoint's entry: {"sha256", "run", "epoch"[, "files"][, "hmac"]}
DIGEST = "sha256"  # the seal's digest of everything else
MAC = "hmac"  # the seal's keyed mark of its digest, run and epoch (this user's key)
KEY_FILE = "seal.key"  # this user's secret key, in config_dir()
KEY_BYTES = 32
FILE_CHUNK = 1 << 24  # bytes read at a time when a file is hashed

log = logging.getLogger("launcher")


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
    HASH_THREADS threads, sooner than on one (a 1 GB checkpoint's digest on 2 cores; measured: BENCHMARKS.md
    sections 7 and 12)."""
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
                if path == "" and key == SEAL and isinstance(value, dict):  # (all of it but its digest and mark)
                    value = {k: v for k, v in value.items() if k not in (DIGEST, MAC)}
                walk(value, f"{path}/{key!r}")
        elif isinstance(obj, (list, tuple)):
            parts.append(f"{path}\0{type(obj).__name__[0]}{len(obj)}\n".encode())
            for i, value in enumerate(obj):
                walk(value, f"{path}/{i}")
        elif isinstance(obj, (set, frozenset)):
            # (in an order of their own: a set of strings iterates in the order each process's hash seed makes)
            parts.append(f"{path}\0set{len(obj)}\n".encode())
            for i, value in enumerate(sorted(obj, key=repr)):
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
    files = [p for p in sorted(Path(folder).iterdir()) if p.is_file()]
    return dict(zip((p.name for p in files), _digests(files), strict=True))


def _digests(files: list[Path]) -> list[str]:
    """file_digest of each, the files hashed side by side (one thread a file, up to the cores: hashlib lets
    go of the interpreter lock while it hashes, and a sharded checkpoint holds a file a rank, each as large as
    its rank's share of the training state)."""
    if len(files) < 2:
        return [file_digest(p) for p in files]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(min(len(files), os.cpu_count() or 1, 16)) as pool:
        return list(pool.map(file_digest, files))


def config_dir(env: os._Environ | dict[str, str] = os.environ) -> Path:
    """Where launch keeps this user's own files: LAUNCH_CONFIG_DIR, else $XDG_CONFIG_HOME/launcher
    (~/.config/launcher)."""
    if env.get("LAUNCH_CONFIG_DIR"):
        return Path(env["LAUNCH_CONFIG_DIR"])
    base = env.get("XDG_CONFIG_HOME") or str(Path(env.get("HOME") or Path.home()) / ".config")
    return Path(base) / "launcher"


def key_path() -> Path:
    return config_dir() / KEY_FILE


_said_no_key: set[str] = set()  # (a key that cannot be made or read is said once per process)


def _no_key(path: Path, why: str) -> None:
    if str(path) not in _said_no_key:
        _said_no_key.add(str(path))
        log.warning("checkpoints are sealed without this user's key (%s %s): resuming or evaluating them asks you "
                    "to confirm any code their config names (model._target_, a recipe module)", path, why)


def user_key(create: bool = False) -> bytes | None:
    """This user's seal key; with `create`, made where there is none yet (random, mode 0600, placed with
    a hard link so that two processes making it at once agree on one). None: there is none (or it cannot
    be made or read: said once)."""
    path = key_path()
    try:
        key = bytes.fromhex(path.read_text().strip())
    except FileNotFoundError:
        if not create:
            return None
    except (OSError, ValueError) as exc:
        _no_key(path, f"cannot be read: {exc}")
        return None
    else:
        if len(key) == KEY_BYTES:
            return key
        _no_key(path, f"holds no key of {KEY_BYTES} bytes")
        return None
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd, name = tempfile.mkstemp(prefix=f".{KEY_FILE}.", dir=path.parent)  # (0600)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(os.urandom(KEY_BYTES).hex() + "\n")
                f.flush()
                os.fsync(f.fileno())
            os.link(name, path)
        except FileExistsError:  # (made this instant by another process: theirs stands)
            pass
        finally:
            os.unlink(name)
    except OSError as exc:
        _no_key(path, f"cannot be made: {exc.strerror or exc}")
        return None
    return user_key()


def _mac(key: bytes, mark: dict[str, Any]) -> str:
    message = f"launch seal 1\0{mark.get(DIGEST)}\0{mark.get('run')}\0{mark.get('epoch')}".encode()
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def seal(state: dict[str, Any], run: str | None, folder: Path | None = None) -> dict[str, Any]:
    """`state` with its seal added (the digest is taken last: nothing is added after it but the mark of
    this user's key, made on first use)."""
    mark: dict[str, Any] = {"run": run, "epoch": state.get("epoch")}
    if folder is not None:
        mark["files"] = folder_digests(folder)
    state[SEAL] = mark
    mark[DIGEST] = state_digest(state)
    key = user_key(create=True)
    if key is not None:
        mark[MAC] = _mac(key, mark)
    return state


def unproven(state: dict[str, Any]) -> str | None:
    """Why the checkpoint `state` is not proven written by a run of this user's, or None where its seal
    carries the mark of this user's key. Asked once `broken_seal` found it whole (the mark vouches for the
    digest; the digest for the contents)."""
    mark = state.get(SEAL)
    if not isinstance(mark, dict):
        return "it carries no seal"
    if not isinstance(mark.get(MAC), str):
        return "its seal carries no mark of a user's key (written by an older launch, or resealed)"
    key = user_key()
    if key is None:
        return f"you have no seal key here, {key_path()}: no run of yours has written a checkpoint"
    if not hmac.compare_digest(mark[MAC].encode(), _mac(key, mark).encode()):  # (bytes: any text compares)
        return "its seal was not made with your key: another user's run, or another machine's"
    return None


def broken_seal(state: dict[str, Any], path: Path) -> str | None:
    """What is wrong with the checkpoint `state`, read from `path`, against its seal: changed contents, a
    changed or missing file of its folder, or another run's checkpoint in this run dir. None: whole (or
    written before seals existed)."""
    mark = state.get(SEAL)
    if mark is None:
        return None
    if not isinstance(mark, dict) or not isinstance(mark.get(DIGEST), str):
        return f"its seal is {str(mark)[:80]!r}, not one launch writes"
    if state_digest(state) != mark[DIGEST]:
        return ("its contents differ from the digest written with it (bytes changed or damaged after it was "
                "saved)")
    files = mark.get("files")
    if isinstance(files, dict) and isinstance(state.get("sharded"), str):
        folder = path.parent / state["sharded"]
        named = [(folder / str(name), digest) for name, digest in sorted(files.items())]
        for file, _ in named:
            if not file.is_file():
                return f"its shard file {file} is missing"
        for (file, digest), found in zip(named, _digests([file for file, _ in named]), strict=True):
            if found != digest:
                return f"its shard file {file} differs from the digest written with it (changed or damaged)"
    if path.parent.name == "checkpoints":
        here = run_id(path.parent.parent)
        if here is not None and mark.get("run") not in (None, here):
            return (f"it belongs to another run (run {mark.get('run')}, epoch {mark.get('epoch')}), not to "
                    f"{path.parent.parent} (run {here}): it was copied in from elsewhere")
    return None
