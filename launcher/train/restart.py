"""Where training starts, and whether a checkpoint fits the network this config builds (`launch eval`'s too).

After a restart (max_restarts) or a SLURM requeue, a run goes on from its own run dir's last checkpoint:
rank 0 checks it against its seal and chooses it or, damaged, the one before (checkpoint.load_restart),
and every rank loads the one it chose. Otherwise from `resume=` (checked in the launcher before any
worker: launcher/host/resume.py), or from the beginning. The checkpoint gives the training state; the
settings are this run's (host/resume.py states the rule): the optimizers' hyper-parameters and learning
rates as configured now, the schedule continued at the epochs done (`optim.continue_with`). A checkpoint
whose weights do not fit this run's network is one line naming what differs (`fitting`), not a traceback.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from launcher.config import to_plain
from launcher.errors import ConfigError
from launcher.files import last_checkpoint
from launcher.train import checkpoint, nodes, optim

if TYPE_CHECKING:
    from launcher.spec import WorkerSpec
    from launcher.strategies import Nets, Strategy
    from launcher.train.step import TrainStep
    from launcher.world import WorldInfo


@dataclass
class Start:
    """Where training starts: after `epoch` finished epochs, with their history, from `source`."""

    epoch: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)
    source: str | None = None
    step: int = 0  # steps of `epoch` already done (a checkpoint written inside an epoch)
    generator: torch.Tensor | None = None  # the augmentation generator's state there
    own: bool = False  # from this run dir's own checkpoint (a restart or requeue): its trackers' runs go on


def resume(spec: WorkerSpec, world: WorldInfo, run_dir: Path, shared: bool, strategy: Strategy,
           device: torch.device, step: TrainStep, steps_per_epoch: int) -> Start:
    """After a restart or requeue, this run's own last checkpoint; else `resume`, if given; restored into
    the step's nets, optimizers and gradient scaler. `shared`: every rank reads the run dir (else rank 0
    reads the checkpoint and sends it)."""
    cfg = spec.config
    own = last_checkpoint(run_dir)
    restarted = world.restart_count > 0 or (spec.requeue is not None and spec.requeue.requeued)
    mine = restarted and own.exists()
    source = str(own) if mine else spec.resume_from
    # (resume= was checked in the launcher, host/resume.py; a restart checks this run's own checkpoint,
    # and goes on from the one before it where that one is damaged)
    if not shared:  # other machines cannot read rank 0's run dir: rank 0 reads, and sends
        state = None
        if source and strategy.is_main:
            if mine:
                chosen, state = checkpoint.load_restart(own, map_location="cpu")
                source = str(chosen)
            else:
                state = checkpoint.load(source, map_location="cpu")
        box = nodes.from_rank0({"source": source, "state": state} if strategy.is_main else None, world)
        source, state = box["source"], box["state"]
        if source is None:
            return Start()
    elif source is None:
        return Start()
    elif mine:
        source, state = _own_checkpoint(own, world, strategy.is_main, device)
    else:
        state = checkpoint.load(source, map_location=device)
    settings = optim.settings(step.steppers)  # this run's, before the checkpoint's replace them
    if strategy.sharded and "sharded" not in state:
        raise ConfigError("resume", spec.resume_from or source, f"a checkpoint of an unsharded run resumes "
                          f"under the strategy that wrote it, not strategy={strategy.name} (sharded runs' "
                          "checkpoints resume under any)", f"strategy=ddp resume={spec.resume_from or source}")
    with fitting(spec, source, state):
        if "sharded" in state:
            checkpoint.restore_sharded(state, Path(source), step.nets, step.steppers, device)
        else:
            checkpoint.restore(state, strategy, step.nets, step.steppers, device, scaler=step.scaler)
    epoch = int(state["epoch"])
    done = 0
    if state.get("step_in_epoch"):  # (written inside an epoch: its position, in samples of the global order)
        samples = int(state["step_in_epoch"]) * int(state.get("batch_size") or cfg.batch_size)
        done = min(samples // cfg.batch_size, steps_per_epoch)
    optim.continue_with(step.steppers, settings, epoch * steps_per_epoch + done)
    generator = state.get("generator") if done else None
    return Start(epoch, list(state.get("history", [])), source, done, generator, own=mine)


def _own_checkpoint(own: Path, world: WorldInfo, is_main: bool, device: torch.device) -> tuple[str, dict[str, Any]]:
    """A restart's checkpoint where every rank reads the run dir: rank 0 checks last.pt against its seal
    (a sharded one's shard files too) and chooses it or, damaged, previous.pt; every rank loads the
    one it chose (they must all go on from the same)."""
    if world.world_size == 1:
        chosen, state = checkpoint.load_restart(own, map_location=device)
        return str(chosen), state
    picked = None
    if is_main:
        chosen, state = checkpoint.load_restart(own, map_location=device)
        picked = str(chosen)
    picked = nodes.from_rank0({"source": picked} if is_main else None, world)["source"]
    if not is_main:
        state = checkpoint.load(picked, map_location=device)
    return picked, state


def load_weights(spec: WorkerSpec, source: str, strategy: Strategy, nets: Nets, device: torch.device) -> dict[str, Any]:
    """`launch eval`: the weights of the checkpoint `source` loaded into `nets` (one line where they do not
    fit), read from launch eval's hard link to it (held still for every rank); the checkpoint returned."""
    read = spec.evaluate_read or source
    state = checkpoint.load(read, map_location=device)
    with fitting(spec, source, state):
        if "sharded" in state:
            checkpoint.load_sharded_weights(state, Path(read), nets)
        else:
            strategy.load_state_dict(nets, state["net_state_dict"])
    return state


@contextlib.contextmanager
def fitting(spec: WorkerSpec, source: str, state: dict[str, Any]) -> Iterator[None]:
    """Loading `state` into this run's network: where it does not fit (shapes, names), one line."""
    try:
        yield
    except BaseException as exc:  # noqa: BLE001 - (DCP's CheckpointException is a BaseException)
        misfit = checkpoint.misfit(exc)
        if misfit is None:
            raise
        raise does_not_fit(spec, source, state, misfit) from None


def does_not_fit(spec: WorkerSpec, source: str, state: dict[str, Any], exc: BaseException) -> ConfigError:
    """The checkpoint's weights (or optimizer state) do not fit the network this config builds: the
    settings it was trained with that differ from this run's, where it says them."""
    cfg = spec.config
    saved = (state.get("config") or {}).get("recipe") or {}
    mine = to_plain(cfg.recipe)
    differ = [f"recipe.{k}={saved[k]}" for k in mine if k in saved and saved[k] != mine[k]]
    first = str(exc).strip().splitlines()[0][:200].rstrip(":")
    target = ((state.get("config") or {}).get("model") or {}).get("_target_")
    if not differ and target and target != (cfg.model or {}).get("_target_"):
        differ = [f"model._target_={target}"]  # (its network came from config)
    hint = (f"it was trained with {' '.join(differ)}" if differ else "the network's layers differ")
    key, value = ("eval.checkpoint", source) if spec.evaluate else ("resume", spec.resume_from or source)
    return ConfigError(key, value, f"the checkpoint does not fit the network this config builds ({hint}: {first})",
                       f"{' '.join(differ) or 'recipe.model=...'} {key}={value}")
