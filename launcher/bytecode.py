"""A bytecode cache for environments that keep none beside torch's sources.

Python compiles every module it imports unless a `.pyc` of it can be read. Installers that skip
compiling (uv without --compile-bytecode, pip --no-compile) combined with PYTHONDONTWRITEBYTECODE=1
(set in many container images) leave torch with no bytecode at all, so every process compiles it
again: on the H200 hosts `import torch`, and more so `import torch, torch._dynamo`, took far longer that
way than from a cache (measured: BENCHMARKS.md section 4). A launch pays that in the launcher, in the
process the workers fork from, and in every SLURM task.

In that case (and only then) `launch` keeps bytecode under its own cache directory through Python's
PYTHONPYCACHEPREFIX, never beside the sources, so the intent of PYTHONDONTWRITEBYTECODE (read-only
or clean source trees) holds. LAUNCH_PYCACHE=0 turns it off, =1 turns it on regardless;
LAUNCH_PYCACHE_DIR moves it. A PYTHONPYCACHEPREFIX the user set is left alone.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import MutableMapping
from pathlib import Path

SWITCH = "LAUNCH_PYCACHE"
DIR = "LAUNCH_PYCACHE_DIR"


def cache_dir(env: MutableMapping[str, str]) -> Path:
    if env.get(DIR):
        return Path(env[DIR]).expanduser()
    base = Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "launcher" / "pycache"


def lacks_bytecode(package: str, dont_write: bool) -> bool:
    """True when importing `package` compiles its sources and Python will not keep the result: no .pyc
    beside its __init__.py, and writing one is off (PYTHONDONTWRITEBYTECODE, -B) or not allowed."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.origin or sys.pycache_prefix is not None:
        return False
    if Path(importlib.util.cache_from_source(spec.origin)).exists():
        return False
    return dont_write or not os.access(Path(spec.origin).parent, os.W_OK)


def enable(env: MutableMapping[str, str] | None = None) -> str | None:
    """Decide for this `launch` and the processes it starts (they inherit `env`); apply it to this
    interpreter. Returns a note to print when the cache directory was made just now, else None."""
    env = os.environ if env is None else env
    switch = env.get(SWITCH, "auto")
    if env.get("PYTHONPYCACHEPREFIX"):
        write_in_this_process(env)  # a launch inside one of ours (a SLURM task): keep writing there
        return None
    if switch == "0" or (switch != "1" and not lacks_bytecode("torch", sys.dont_write_bytecode)):
        return None
    folder = cache_dir(env)
    new = not folder.exists()
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None  # no cache then: a launch must not fail over a speed-up
    if not os.access(folder, os.W_OK):
        return None
    env["PYTHONPYCACHEPREFIX"] = str(folder)
    env[SWITCH] = "1"  # children write too (see write_in_this_process)
    write_in_this_process(env)
    if not new:
        return None
    why = "PYTHONDONTWRITEBYTECODE" if sys.flags.dont_write_bytecode else "torch's folder is read-only"
    return (f"launch: torch has no Python bytecode here and Python writes none ({why}); keeping it "
            f"under {folder} so later launches start faster ({SWITCH}=0 turns this off)")


def write_in_this_process(env: MutableMapping[str, str] | None = None) -> None:
    """Write bytecode into the prefix in this interpreter. Child interpreters of multiprocessing get
    -B when the launcher had PYTHONDONTWRITEBYTECODE, so the forkserver calls this before its imports."""
    env = os.environ if env is None else env
    if env.get(SWITCH) == "1" and env.get("PYTHONPYCACHEPREFIX"):
        sys.pycache_prefix = env["PYTHONPYCACHEPREFIX"]
        sys.dont_write_bytecode = False
