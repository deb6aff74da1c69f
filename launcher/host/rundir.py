"""A launch writes only into a run dir it claimed, and removes only what it created.

A launch's run dir (hydra.run.dir; a sweep's hydra.sweep.dir) is claimed before Hydra writes anything
into it (a Hydra callback, `RunDirClaim`, runs before Hydra's own run): the dir must be new or empty,
and the claim is a file created with O_EXCL, so two launches started together on one dir cannot both
have it. The claim stays as the mark of the run (who, where, when: `launch runs` reads it):

    refused   the dir holds a launch's run (finished, failed, or being written by a live process),
              or files that launch did not write (a user's own folder); one line, exit 2
    claimed   a new dir (made here, with any missing parents) or an existing empty one

When a launch started nothing (input refused, a dry run), `release` takes back exactly what it made:
its claim and Hydra's .hydra/, the dir if this launch created it, and the parents it created. A dir
that existed before (the current directory included) is never removed.

Inside torchrun/srun only rank 0 claims: every rank runs `launch` with the same run dir.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback

from launcher.errors import LaunchError
from launcher.files import CLAIM, RESULTS, SWEEP_MARK, last_checkpoint, read_json
from launcher.world import existing_world

HYDRA_DIR = ".hydra"
HYDRA_FILES = {HYDRA_DIR, "multirun.yaml"}  # what Hydra writes into a run's or a sweep's dir


@dataclass
class Claim:
    path: Path
    created: list[Path] = field(default_factory=list)  # dirs this launch made, deepest first


_claims: dict[Path, Claim] = {}


def read_claim(run_dir: Path) -> dict[str, Any] | None:
    return read_json(Path(run_dir) / CLAIM) or None


def pid_alive(pid: Any, host: Any) -> bool:
    """Whether the process that wrote a claim still runs (only answerable on the host that wrote it)."""
    from launcher.lifetime import process_alive

    if host != socket.gethostname() or not isinstance(pid, int):
        return False
    return process_alive(pid)


def _why_taken(path: Path, setting: str) -> str | None:
    """Why `path` cannot be this launch's run dir, or None when it can (new, or an empty dir)."""
    if path.exists() and not path.is_dir():
        return f"{setting}={path} is a file, not a folder: pick a new folder name"
    entries = sorted(p.name for p in path.iterdir()) if path.is_dir() else []
    if not entries:
        return None
    claim = read_claim(path)
    if claim is None and CLAIM in entries:
        claim = _claim_once_written(path)
    again = f"pick another {setting} (or leave it out: each launch gets a new dir under outputs/)"
    if claim is not None and pid_alive(claim.get("pid"), claim.get("host")):
        return (f"{setting}={path} is being written by another launch (pid {claim['pid']}, started "
                f"{claim.get('started', '?')}); two launches never share a run dir: {again}")
    if (claim is not None or CLAIM in entries or (path / RESULTS).exists() or last_checkpoint(path).exists()
            or HYDRA_DIR in entries):
        return (f"{setting}={path} already holds a run: continue it with resume={path} (in a new dir), "
                f"or {again}")
    shown = ", ".join(entries[:4]) + (", ..." if len(entries) > 4 else "")
    return (f"{setting}={path} holds files launch did not write ({shown}); launch never writes into them: "
            f"{again}")


def _claim_once_written(path: Path, wait_s: float = 1.0) -> dict[str, Any] | None:
    """A claim file found empty: another launch created it this instant and is writing it (two
    launches started together on one dir; it was taken for a user's own file). Its content, once there;
    None if it stays empty or torn (a launch killed between the two steps: still launch's mark)."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        time.sleep(0.02)
        claim = read_claim(path)
        if claim is not None:
            return claim
    return None


def _stale_world_hint() -> str:
    world_vars = [k for k in ("TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
                  if k in os.environ]
    return (f". (launch read {', '.join(world_vars)} from the environment and took itself for a rank of a "
            f"torchrun world, whose ranks share one run dir; if this shell is not inside torchrun, "
            f"`unset {' '.join(world_vars)}`)")


def claim(path: Path, setting: str = "hydra.run.dir") -> Claim | None:
    """Claim `path` for this launch, or raise LaunchError saying why not. None: not ours to claim
    (a rank other than 0 of a world torchrun/srun started)."""
    world = existing_world()
    if world is not None and world.rank != 0:
        return None
    path = Path(path).absolute()
    why = _why_taken(path, setting)
    if why:
        raise LaunchError(why + (_stale_world_hint() if world is not None else ""))
    created = []
    missing = path
    while not missing.exists():
        created.append(missing)
        missing = missing.parent
    try:
        path.mkdir(parents=True, exist_ok=True)
        record = {"pid": os.getpid(), "host": socket.gethostname(),
                  "started": time.strftime("%Y-%m-%d %H:%M:%S"), "argv": sys.argv[1:],
                  "setting": setting}  # (hydra.sweep.dir: a sweep's own dir, which `launch runs` does not list)
        fd = os.open(path / CLAIM, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        raise LaunchError(_why_taken(path, setting) or f"{setting}={path} was claimed by another launch") from None
    except OSError as err:
        raise LaunchError(f"{setting}={path} cannot be created: {err.strerror} ({err.filename or path})") from None
    with os.fdopen(fd, "wb") as f:  # one write: a launch racing for the dir reads it whole, or waits
        f.write(json.dumps(record).encode())
    taken = Claim(path, created)
    _claims[path] = taken
    return taken


def release(run_dir: Path) -> None:
    """After a launch that started nothing: remove its claim and Hydra's files, and the dirs it made.
    Anything else found in the dir (and any dir this launch did not create) stays."""
    path = Path(run_dir).absolute()
    taken = _claims.pop(path, None)
    if not path.is_dir():
        return
    entries = {p.name for p in path.iterdir()}
    if not entries <= HYDRA_FILES | {CLAIM, SWEEP_MARK}:
        return  # something ran and wrote here: keep it
    if taken is None:  # a sweep's run dir (made by Hydra inside the claimed sweep dir): only the dir itself
        shutil.rmtree(path, ignore_errors=True)
        return
    shutil.rmtree(path / HYDRA_DIR, ignore_errors=True)
    (path / "multirun.yaml").unlink(missing_ok=True)
    (path / SWEEP_MARK).unlink(missing_ok=True)  # (launch -m marks its sweep dir before it composes the runs)
    (path / CLAIM).unlink(missing_ok=True)
    for made in taken.created:  # deepest first; never a dir that existed before this launch
        try:
            made.rmdir()
        except OSError:
            break


def release_unused() -> None:
    """At the end of a command: release every dir it claimed where nothing ran (a refused sweep)."""
    for path in list(_claims):
        release(path)


class Refused(BaseException):  # noqa: N818 - not an Exception: Hydra turns a callback's Exception into a warning
    """A claim refused inside Hydra's callback; cli.main prints it as one line and exits 2."""

    def __init__(self, error: LaunchError):
        super().__init__(str(error))
        self.error = error


class RunDirClaim(Callback):
    """The Hydra callback (conf/config.yaml: hydra.callbacks) that claims a run's or a sweep's dir
    before Hydra writes into it."""

    def on_run_start(self, config: Any, **kwargs: Any) -> None:
        self._claim(config, "hydra.run.dir")

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        self._claim(config, "hydra.sweep.dir")
        from omegaconf import OmegaConf

        from launcher.host.compose import SWEEP_LAUNCHER
        from launcher.lifetime import let_ctrl_c_through, tie_joblib_workers

        target = str(OmegaConf.select(config, "hydra.launcher._target_"))
        if target != SWEEP_LAUNCHER:
            # Another Hydra launcher (joblib, submitit) runs the sweep from here; `launch` held Ctrl-C
            # until now (cli.main) and its own sweep launcher hands it back itself, after composing.
            let_ctrl_c_through("torch")
        if target.startswith("hydra_plugins.hydra_joblib_launcher."):
            tie_joblib_workers()

    @staticmethod
    def _claim(config: Any, setting: str) -> None:
        from omegaconf import OmegaConf

        try:
            claim(Path(str(OmegaConf.select(config, setting))), setting)
        except LaunchError as err:
            raise Refused(err) from None
