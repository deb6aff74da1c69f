"""Before any worker: whether each device can hold the run's training state, from the model's size.

A recipe that can build its network before the data is read (`Recipe.model_to_size`: recipe=text, on the meta
device, so an 8B model costs no memory here) has its parameters counted; each device must hold their weights,
gradients and the optimizer's state (fp32: 4 bytes each, times 2 + the optimizer's copies; divided by the ranks
under a sharding strategy), before any activation. Where that alone is more than the device holds (a GPU's
memory, as NVML reports it; on the CPU the memory available to the ranks together), the launch is refused in one
line naming the estimate and a setting that fits, instead of an out-of-memory error in every worker after
their start-up (and a compile). Activations come on top: an estimate that passes can still run out (the
worker then says so: launcher/train/stops.py)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from launcher.errors import LaunchError

if TYPE_CHECKING:
    from launcher.host.plan import Plan
    from launcher.recipes import Recipe

GIB = 2**30


def training_state(recipe: Recipe, plan: Plan) -> tuple[int, int] | None:
    """(parameters, bytes each rank holds for them), or None where the recipe cannot say before its data."""
    model = recipe.model_to_size()
    if model is None:
        return None
    count = sum(p.numel() for p in model.parameters())
    per_param = 4 * (2 + plan.config.optim.state_copies)
    ranks = plan.strategy.world_size if plan.strategy.sharded else 1
    return count, math.ceil(count * per_param / ranks)


def capacity(plan: Plan) -> tuple[int, str] | None:
    """(bytes, what) one rank may use: the smallest chosen GPU's memory, or on the CPU the memory available
    now shared by this host's ranks; None where it cannot be read."""
    if plan.gpu_ids:
        from launcher.host.gpus import gpu_loads

        loads = gpu_loads(plan.visible)
        if not loads:
            return None
        chosen = [load for load in loads if load.index in plan.gpu_ids] or loads
        smallest = min(chosen, key=lambda load: load.total_gib)
        return (int(smallest.total_gib * GIB),
                f"GPU {smallest.index} ({smallest.name}) holds {smallest.total_gib:.0f} GiB")
    try:
        with open("/proc/meminfo") as info:
            fields = dict(line.split(":", 1) for line in info)
        available = int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None
    ranks = plan.strategy.processes
    share = f", {available / ranks / GIB:.0f} GiB for each of its {ranks} ranks" if ranks > 1 else ""
    return available // ranks, f"this machine has {available / GIB:.0f} GiB of memory available{share}"


def check_fits(recipe: Recipe, plan: Plan) -> None:
    """Refuse (exit 2, one line) a run whose training state alone does not fit its devices."""
    state = training_state(recipe, plan)
    room = capacity(plan) if state else None
    if state is None or room is None:
        return
    (count, need), (holds, where) = state, room
    if need <= holds:
        return
    cfg = plan.config
    what = f"{count / 1e9:.2f}B parameters" if count >= 1e8 else f"{count / 1e6:.0f}M parameters"
    copies = cfg.optim.state_copies
    held = (f"weights, gradients and {cfg.optim.name}'s {copies} state tensor{'s' if copies != 1 else ''} in fp32 "
            f"({4 * (2 + copies)} bytes a parameter)")
    shard = f", divided over {plan.strategy.world_size} ranks by {plan.strategy.name}" if plan.strategy.sharded else ""
    if plan.gpu_ids and not plan.strategy.sharded:
        gpus = max(2, math.ceil(need / (0.6 * holds)))
        fix = (f"shard them: strategy=fsdp strategy.meta_init=true gpus={gpus} (~{need / gpus / GIB:.0f} GiB each), "
               "or a smaller model")
    elif plan.gpu_ids:
        fix = "more GPUs (fsdp divides the state by their number), or a smaller model"
    else:
        fix = "a smaller model (recipe.size=1b, or fewer recipe.layers / a smaller recipe.width), or GPUs"
    raise LaunchError(f"recipe={cfg.recipe.name}: the model's {what} need ~{need / GIB:.0f} GiB a rank for their "
                      f"{held}{shard}, before any activation; {where}: {fix}")
