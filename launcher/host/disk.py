"""Before any worker: whether the run dir's disk has room for the run's checkpoints.

A checkpoint holds the weights in fp32 and the optimizer's state (4 bytes a parameter each: AdamW's two moments,
SGD's momentum), whether one file (last.pt) or a sharded folder beside it (which holds a tied weight under each of
its names): an 8B model's comes to ~96 GB. While one is written the last is still on disk (a sharded run's one
before it too, unless checkpoint.keep_previous=false), and each of checkpoint.keep_best's may hold one more. A run
whose disk lacks that room would train until a save failed for want of space (said then in one line:
launcher/files.py DiskFull), hours into an 8B run; so where the model's parameters were counted before the
workers (launcher/host/memory.py), the launch is refused in one line naming the need, the room and what fits,
instead (checkpoint.check_disk=false starts it anyway).

A run restarted in its run dir (torchrun's --max-restarts, an srun requeue) counts the room its own checkpoints
there hold; the launcher's own SLURM requeue is not judged again. Nothing is refused that could fit, so some
needs go uncounted: checkpoint_every_steps's saves inside an epoch (its length is the data's, unknown here), the
other runs of a sweep on the same disk, and a host of a several-host run that writes no checkpoint or does not
know its node's rank yet. On several hosts a sharded checkpoint is counted as this host's ranks' share (the
first host's share, where the file system is shared).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from launcher.errors import LaunchError
from launcher.files import CHECKPOINTS, free_bytes

if TYPE_CHECKING:
    from launcher.host.memory import Fit
    from launcher.host.plan import Plan

GB = 1e9


def _said(nbytes: float) -> str:
    return f"{nbytes / 1e12:.2f} TB" if nbytes >= 1e12 else f"{nbytes / GB:.1f} GB" if nbytes >= GB \
        else f"{nbytes / 1e6:.0f} MB" if nbytes >= 1e6 else f"{nbytes / 1e3:.0f} kB"


def checkpoint_bytes(fit: Fit, state_copies: int, sharded: bool) -> int:
    """One checkpoint's tensors: the fp32 weights of the model's state_dict (a tied weight once in a whole
    last.pt, under each of its names in a sharded folder) and the optimizer's `state_copies` tensors of each
    parameter's size."""
    whole, by_name = fit.stored
    return 4 * (by_name if sharded else whole) + 4 * state_copies * fit.parameters


def copies_at_once(plan: Plan, epochs_left: int, keep_best: int | None = None,
                   keep_previous: bool | None = None) -> tuple[int, str]:
    """(the most checkpoints of the run on disk at once, which they are), never more than the epoch ends it saves
    at (checkpoint_every_steps may save more, inside epochs of a length the data decides, unknown here: not
    counted, so that nothing is refused that could fit): the one being written and the last; under a sharded
    strategy also the one before the last, unless checkpoint.keep_previous=false (a whole last.pt becomes
    previous.pt's second name before the next is written, so the one before it is gone by then); and
    checkpoint.keep_best's. `keep_best` and `keep_previous` in place of the config's."""
    cfg, sharded = plan.config, plan.strategy.sharded
    best = cfg.checkpoint.keep_best if keep_best is None else keep_best
    previous = sharded and (cfg.checkpoint.keep_previous if keep_previous is None else keep_previous)
    count = min(epochs_left, 2 + previous + best)
    kept = ["the one being written", "the last", "the one before it"][:min(count, 2 + previous)]
    if count > 2 + previous:
        kept.append(f"up to {count - 2 - previous} best")
    return count, ", ".join(kept[:-1]) + " and " + kept[-1] if len(kept) > 1 else kept[0]


def this_hosts_share(plan: Plan) -> float:
    """The part of each checkpoint this host writes: all of a whole one where it holds rank 0 (none on the other
    hosts), its ranks' shards of a sharded one."""
    s = plan.strategy
    if s.world_size <= s.processes:
        return 1.0
    if s.sharded:
        return s.processes / s.world_size
    first = plan.joined.rank == 0 if plan.joined is not None else plan.config.node_rank == 0
    return 1.0 if first else 0.0


def held_by(folder: Path) -> int:
    """The bytes of the files under `folder` (each file once, however many names it has): a restarted run's
    own checkpoints, whose room its next saves take over."""
    seen: dict[tuple[int, int], int] = {}
    for path in folder.rglob("*") if folder.is_dir() else ():
        try:
            info = path.lstat()
        except OSError:
            continue
        if path.is_file() and not path.is_symlink():
            seen[(info.st_dev, info.st_ino)] = info.st_size
    return sum(seen.values())


def check_room(plan: Plan, run_dir: Path, fit: Fit, epochs_left: int) -> str | None:
    """Refuse (exit 2, one line) a run whose checkpoints outgrow the free space where its run dir will be (with
    the room its own checkpoints there hold: a restart's). Returns the estimate in a line (`launch ...
    dry_run=true` shows it); None where nothing was judged."""
    cfg = plan.config
    share = this_hosts_share(plan)
    parameters = fit.parameters
    if not cfg.saves or parameters <= 0 or epochs_left <= 0 or share == 0:
        return None
    where = next((p for p in (run_dir, *run_dir.parents) if p.exists()), None)
    free = free_bytes(where) if where is not None else None
    if free is None:
        return None
    own = held_by(run_dir / CHECKPOINTS)
    copies = cfg.optim.state_copies
    one = checkpoint_bytes(fit, copies, plan.strategy.sharded) * share
    count, which = copies_at_once(plan, epochs_left)
    what = f"{parameters / 1e9:.2f}B" if parameters >= 1e8 else f"{parameters / 1e6:.0f}M" if parameters >= 1e6 \
        else f"{parameters / 1e3:.0f}k"
    held = f"{what} parameters: fp32 weights and {cfg.optim.name}'s {copies} state tensor{'s' if copies != 1 else ''}"
    part = "" if share == 1 else f" (this host's {share:.0%} of each)"
    mine = f" and {_said(own)} in its own checkpoints" if own else ""
    room = free + own
    at_once = f"up to {count} on disk at once ({which}): ~{_said(one * count)}" if count > 1 else "one save"
    if one * count <= room:
        return (f"~{_said(one)} each{part} ({held}), {at_once}; {_said(free)} free{mine} where the run dir goes "
                f"({where})")
    if not cfg.checkpoint.check_disk:
        return (f"~{_said(one)} each{part} ({held}), {at_once}; only {_said(free)} free{mine} where the run dir goes "
                f"({where}): not refused (checkpoint.check_disk=false)")
    fixes = []
    no_best = copies_at_once(plan, epochs_left, keep_best=0)[0]
    fewer = copies_at_once(plan, epochs_left, keep_previous=False)[0]
    both = copies_at_once(plan, epochs_left, keep_best=0, keep_previous=False)[0]
    if cfg.checkpoint.keep_best and one * no_best <= room:
        fixes.append("checkpoint.keep_best=0")
    if fewer < count and one * fewer <= room:
        fixes.append(f"checkpoint.keep_previous=false (~{_said(one * fewer)}: one fewer at once)")
    if not fixes and both < count and one * both <= room:
        fixes.append(f"checkpoint.keep_best=0 checkpoint.keep_previous=false (~{_said(one * both)})")
    fixes += ["a run dir on a disk with room (hydra.run.dir=/a/bigger/disk/run; a sweep's hydra.sweep.dir)",
              "checkpoint=false", "checkpoint.check_disk=false to start anyway"]
    need = f"up to {count} are on disk at once ({which}): ~{_said(one * count)}" if count > 1 else \
        "the run saves one"
    raise LaunchError(f"checkpoints of this run hold ~{_said(one)} each{part} ({held}); {need}, and the run dir's "
                      f"file system has {_said(free)} free{mine} ({where}): {', or '.join(fixes)}")
