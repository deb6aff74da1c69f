"""Decoded datasets kept on disk between runs, so a run's data loads in a fraction of a second.

A recipe that decodes its data (CIFAR-10's pickled batches) or generates it (data.synthetic=true)
does so once: the arrays are saved as uncompressed .npy files under ~/.cache/launcher/decoded/<key>/
(XDG_CACHE_HOME and LAUNCH_CACHE_DIR move it), and later runs read them back. The key names what
was decoded and from which files (their paths, sizes and modification times), so a changed source
is decoded again. Each rank of a run may be the one to write the cache: files are written under a
temporary name and renamed into place, and a failure to write (a read-only home, a full disk) costs
only the cache, never the run. Nothing here touches the dataset's own folder.
"""

from __future__ import annotations

import hashlib
import logging
import os
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from launcher.errors import LaunchError

if TYPE_CHECKING:
    import numpy as np

log = logging.getLogger("launcher.data")

VERSION = 1  # bump when a recipe's decoded layout changes


def cache_root(env: os._Environ | dict[str, str] = os.environ) -> Path:
    """~/.cache/launcher (XDG_CACHE_HOME/launcher, or LAUNCH_CACHE_DIR)."""
    if env.get("LAUNCH_CACHE_DIR"):
        return Path(env["LAUNCH_CACHE_DIR"])
    base = env.get("XDG_CACHE_HOME") or str(Path(env.get("HOME") or Path.home()) / ".cache")
    return Path(base) / "launcher"


def default_data_root(env: os._Environ | dict[str, str] = os.environ) -> Path:
    """data.root's default (launcher/config.py DataConfig.root): LAUNCH_DATA_ROOT, else ~/.cache/launcher/data,
    where datasets are downloaded and recipe=text keeps its byte copies of text corpora (`text/`)."""
    from launcher.config import DEFAULT_DATA_ROOT

    given = env.get("LAUNCH_DATA_ROOT") or DEFAULT_DATA_ROOT
    home = str(env.get("HOME") or Path.home())
    return Path(home + given[1:] if given == "~" or given.startswith("~/") else given)


def inductor_dir(env: os._Environ | dict[str, str] = os.environ) -> Path:
    """Where inductor's caches go (launcher/train/compiling.py points torch.compile there; `launch doctor`
    reports it): TORCHINDUCTOR_CACHE_DIR, else <cache root>/inductor."""
    if env.get("TORCHINDUCTOR_CACHE_DIR"):
        return Path(env["TORCHINDUCTOR_CACHE_DIR"])
    return cache_root(env) / "inductor"


def _unusable(folder: Path) -> str | None:
    """Why `folder` cannot hold a cache (made if missing), or None when it can."""
    if folder.exists() and not folder.is_dir():
        return "it is a file, not a folder"
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return exc.strerror or str(exc)
    if not os.access(folder, os.W_OK | os.X_OK):
        return "not writable"
    return None


def why_unusable(folder: Path) -> str | None:
    """Why `folder` could not hold a cache, found without making anything (`launch doctor`): a file where
    it or a folder above it should be, or a nearest existing folder that cannot be written."""
    probe = Path(folder)
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    if not probe.is_dir():
        return f"{probe} is a file, not a folder"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"{probe} is not writable"
    return None


def prepare_inductor_dir(env: os._Environ | dict[str, str] = os.environ) -> None:
    """Before anything launch starts imports torch: TORCHINDUCTOR_CACHE_DIR names a folder that exists and
    can be written, so the processes torch is imported in (the forkserver, whose import of torch._dynamo
    already makes that folder, and the workers) agree on one place.

    A TORCHINDUCTOR_CACHE_DIR the user set that cannot be used raises LaunchError (torch fails to import
    its compiler without it: a traceback from the forkserver otherwise). The launcher's own default
    (~/.cache/launcher/inductor) that cannot be made (a read-only home) is left unset: torch then keeps
    its caches in its own default folder, and the run goes on."""
    user = env.get("TORCHINDUCTOR_CACHE_DIR")
    folder = Path(user).expanduser() if user else inductor_dir(env)
    problem = _unusable(folder)
    if problem is None:
        env["TORCHINDUCTOR_CACHE_DIR"] = str(folder)
    elif user:
        raise LaunchError(f"TORCHINDUCTOR_CACHE_DIR={user} cannot hold torch's compiled kernels ({problem}), and "
                          "torch cannot import its compiler without it; point it at a writable folder or unset it "
                          "(launch then uses ~/.cache/launcher/inductor): unset TORCHINDUCTOR_CACHE_DIR")


def key_for(name: str, sources: Iterable[Path] = (), **params: object) -> str:
    """A cache key: `name`, the parameters, and each source file's path, size and modification time."""
    digest = hashlib.sha256(f"v{VERSION} {name} {sorted(params.items())}".encode())
    for path in sources:
        stat = path.stat()
        digest.update(f"{path.resolve()} {stat.st_size} {stat.st_mtime_ns}".encode())
    return f"{name}-{digest.hexdigest()[:16]}"


def cached(key: str, build: Callable[[], dict[str, np.ndarray]], root: Path | None = None) -> dict[str, np.ndarray]:
    """The arrays saved under `key`, or `build()`'s, saved for next time."""
    import numpy as np

    folder = (root or cache_root() / "decoded") / key
    done = folder / "complete"
    if done.exists():
        try:
            names = done.read_text().split()
            return {name: np.load(folder / f"{name}.npy") for name in names}
        except (OSError, ValueError) as exc:
            log.debug("data cache %s unreadable (%s): decoding again", folder, exc)
    arrays = build()
    temporary = None
    try:
        folder.mkdir(parents=True, exist_ok=True)
        for name, array in arrays.items():
            temporary = folder / f".{name}.{uuid.uuid4().hex}.tmp.npy"
            np.save(temporary, np.ascontiguousarray(array))
            os.replace(temporary, folder / f"{name}.npy")
        temporary = folder / f".complete.{uuid.uuid4().hex}.tmp"
        temporary.write_text(" ".join(arrays))
        os.replace(temporary, done)
    except OSError as exc:
        log.debug("data cache %s not written (%s)", folder, exc)
        if temporary is not None:  # a full disk leaves no half-written array behind
            temporary.unlink(missing_ok=True)
    return arrays
