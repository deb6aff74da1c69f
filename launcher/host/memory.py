"""Before any worker: whether each device can hold the run's training state, from the model's size.

A recipe that can build its network before the data is read (`Recipe.model_to_size`: recipe=text, on the meta
device, so an 8B model costs no memory here) has its parameters counted; each device must hold their weights,
gradients and the optimizer's state (fp32: 4 bytes each, times 2 + the optimizer's copies; divided by the ranks
under a sharding strategy), before any activation. Where that alone is more than the device holds (a GPU's
memory, as NVML reports it; on the CPU the memory available to the ranks together), the launch is refused in one
line naming the estimate and a setting that fits, instead of an out-of-memory error in every worker after
their start-up (and a compile). Then the activations the backward pass keeps at the run's micro-batch, measured
by one forward on the meta device (`Recipe.batch_to_size`; launcher/strategies/recompute.py: activation_bytes)
under the run's perf.activation_checkpointing: where state and activations together outgrow the device, the
line names the estimate and the checkpointing mode or the batch size that fits. Temporary buffers, the CUDA
context and the allocator's slack come on top: an estimate that passes can still run out (the worker then says
so: launcher/train/stops.py). What the estimate leaves of the device (`Fit.spare_bytes`, less a margin for those)
is told to the strategy (`Strategy.fit_memory`), which may spend it on speed: fsdp keeps each unit's gathered
weights from its forward to its backward where they fit there."""

from __future__ import annotations

import math
import os
import pickle
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from launcher.errors import LaunchError

if TYPE_CHECKING:
    from torch import nn

    from launcher.host.plan import Plan
    from launcher.recipes import Recipe
    from launcher.strategies.recompute import Activations

GIB = 2**30
T = TypeVar("T")
MARGIN = 0.15  # the share of a device kept out of `Fit.spare_bytes`: temporaries, the CUDA context, the allocator


@dataclass(frozen=True)
class Fit:
    """What the check found of a run that fits (a run that does not is refused: LaunchError)."""

    line: str | None = None  # the estimate in a line (`launch ... dry_run=true` shows it); None where there is none
    parameters: int = 0  # the model's, counted on the meta device (0: not counted)
    spare_bytes: int | None = None  # a rank's device less the state, the activations and MARGIN; None: not estimated
    stored: tuple[int, int] = (0, 0)  # the elements of its state_dict: a tied weight once, and under each name


def stored_elements(model: nn.Module) -> tuple[int, int]:
    """(the elements of `model`'s state_dict with a tied weight counted once, as torch.save stores it; with each
    name counted, as torch.distributed.checkpoint writes a sharded checkpoint): what a checkpoint's weights hold."""
    import torch

    tensors = [t for t in model.state_dict(keep_vars=True).values()
               if isinstance(t, torch.Tensor) and t.is_floating_point()]
    return sum({id(t): t.numel() for t in tensors}.values()), sum(t.numel() for t in tensors)


def training_state(model: nn.Module, plan: Plan) -> tuple[int, int]:
    """(parameters, bytes each rank holds for them) of `model` (built on the meta device)."""
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


def check_fits(recipe: Recipe, plan: Plan) -> Fit:
    """Refuse (exit 2, one line) a run whose training state, or its state and activations, do not fit its
    devices. Returns what was found of one that fits: its estimate in a line, and what it leaves spare."""
    return in_child(_check_fits, recipe, plan)


def in_child(check: Callable[..., T], *args: Any) -> T:
    """`check(*args)`'s result, run in a child forked for it on Linux (elsewhere here), its LaunchError
    raised here: a check that builds the recipe's model (on the meta device) keeps whatever torch's layers
    touch out of the launch process. At b19ff93 recipe=text's LSTM and GRU failed on a GPU machine with
    "CUDA error: initialization error" in their workers (forked from the launch under
    LAUNCH_START_METHOD=fork) after the memory check ran in the launch itself, where GPT's and Llama's did
    not; a CUDA context in the launch process would also hold a GPU's memory for the whole run."""
    if sys.platform != "linux":
        return check(*args)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: the verdict back through the pipe, then out without the launch's exit handlers,
        try:  # whatever happens (it must never go on to run the launch's own code)
            os.close(read)
            try:
                verdict: tuple[str, Any] = ("done", check(*args))
            except LaunchError as refused:
                verdict = ("refused", str(refused))
            except BaseException as error:  # noqa: BLE001 - told to the parent, which decides
                verdict = ("failed", f"{type(error).__name__}: {error}")
            with os.fdopen(write, "wb") as out:
                pickle.dump(verdict, out)
        finally:
            os._exit(0)
    os.close(write)
    try:
        with os.fdopen(read, "rb") as got:
            raw = got.read()
    except BaseException:  # (Ctrl-C while it runs: the child goes with the launch)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        raise
    os.waitpid(pid, 0)
    kind, said = pickle.loads(raw) if raw else ("failed", "the check's process ended without a verdict")
    if kind == "refused":
        raise LaunchError(str(said))
    if kind == "failed":
        raise RuntimeError(f"the check before the workers ({getattr(check, '__name__', check)}) failed: {said}")
    return said


def _check_fits(recipe: Recipe, plan: Plan) -> Fit:
    from launcher.models import configured

    if configured(plan.config.model):  # (not the recipe's own: the launcher builds none of those, launcher/models.py)
        return Fit("not estimated: a network from config (model._target_) is built in the workers only")
    model = recipe.model_to_size()
    if model is None:
        return Fit()
    count, need = training_state(model, plan)
    stored = stored_elements(model)
    room = capacity(plan)
    if room is None:
        return Fit(parameters=count, stored=stored)
    holds, where = room
    if need <= holds:
        line, used = check_activations(recipe, model, plan, need, holds, where)
        spare = None if used is None else int(holds * (1 - MARGIN)) - used
        return Fit(line, count, spare, stored)
    cfg = plan.config
    what = f"{count / 1e9:.2f}B parameters" if count >= 1e8 else f"{count / 1e6:.0f}M parameters"
    copies = cfg.optim.state_copies
    held = (f"weights, gradients and {cfg.optim.name}'s {copies} state tensor{'s' if copies != 1 else ''} in fp32 "
            f"({4 * (2 + copies)} bytes a parameter)")
    shard = f", divided over {plan.strategy.world_size} ranks by {plan.strategy.name}" if plan.strategy.sharded else ""
    raise LaunchError(f"recipe={cfg.recipe.name}: the model's {what} need ~{need / GIB:.0f} GiB a rank for their "
                      f"{held}{shard}, before any activation; {where}: {_what_fits(plan, need, holds)}")


def _what_fits(plan: Plan, need: int, holds: int) -> str:
    """What to type where the training state (`need` bytes a rank) outgrows what a rank `holds`: fsdp over
    enough GPUs; on the CPU, fsdp over the ranks already asked for where their memory together holds the
    state (ddp and single keep all of it in each rank); else a smaller model."""
    smaller = "a smaller model (a smaller recipe.size, fewer recipe.layers or a smaller recipe.width)"
    ranks = plan.strategy.processes
    if plan.gpu_ids and not plan.strategy.sharded:
        gpus = max(2, math.ceil(need / (0.6 * holds)))
        return (f"shard them: strategy=fsdp strategy.meta_init=true gpus={gpus} (~{need / gpus / GIB:.0f} GiB each), "
                f"or {smaller}")
    if plan.gpu_ids:
        return f"more GPUs (fsdp divides the state by their number), or {smaller}"
    if not plan.strategy.sharded and ranks > 1 and need / ranks <= 0.8 * holds:
        return (f"shard them over the {ranks} ranks: strategy=fsdp strategy.meta_init=true (~{need / ranks / GIB:.0f} "
                f"GiB each), or {smaller}, or GPUs")
    return f"{smaller}, or GPUs"


def activations(recipe: Recipe, model: nn.Module, plan: Plan,
                micro: int | None = None) -> tuple[Activations, int] | None:
    """(the activations one rank keeps, under each checkpointing mode; the micro-batch they are for: the run's,
    or `micro`), measured by a forward of `model` (the recipe's, on the meta device) in the dtype the run
    computes in; None where the recipe cannot give a batch before its data, or the forward cannot run on the
    meta device (the run is then not judged by it)."""
    import torch

    from launcher.config import Precision
    from launcher.strategies.recompute import activation_bytes

    cfg, strategy = plan.config, plan.strategy
    micro = micro or max(1, strategy.batch_per_process // max(1, strategy.accumulate))
    try:
        batch = recipe.batch_to_size(micro)
        if batch is None:
            return None
        precision = cfg.perf.precision
        half = (Precision.bf16, Precision.fp16, Precision.fp8)  # (fp8: bf16 outside its matmuls)
        if precision in half or (precision is Precision.auto and plan.gpu_ids):
            model = model.to(torch.float16 if precision is Precision.fp16 else torch.bfloat16)
        return activation_bytes(model, lambda: recipe.training_step(model, batch)), micro
    except Exception:  # noqa: BLE001 - an estimate only: a model the meta device cannot run is not refused for it
        return None


def check_activations(recipe: Recipe, model: nn.Module, plan: Plan, state_bytes: int, holds: int,
                      where: str) -> tuple[str, int | None]:
    """Refuse (exit 2, one line) a run whose training state and activations together outgrow its devices,
    naming what fits: a checkpointing mode, else a smaller batch. Returns the estimate that fits, in a line,
    and the bytes it comes to a rank (None where the activations could not be estimated)."""
    from launcher.config import Recompute
    from launcher.strategies.recompute import mode_of

    measured = activations(recipe, model, plan)
    state = f"~{state_bytes / GIB:.1f} GiB of weights, gradients and optimizer state"
    if measured is None:
        return f"{state} a rank (activations not estimated); {where}", None
    estimate, micro = measured
    mode = mode_of(plan.config)
    if state_bytes + estimate.under(mode) <= holds:
        others = ", ".join(f"{m.value} ~{estimate.under(m) / GIB:.1f} GiB" for m in Recompute if m is not mode)
        return (f"~{(state_bytes + estimate.under(mode)) / GIB:.1f} GiB a rank: {state} + "
                f"~{estimate.under(mode) / GIB:.1f} GiB of activations at a micro-batch of {micro} "
                f"(perf.activation_checkpointing={mode.value}; {others}); {where}"), state_bytes + estimate.under(mode)
    cfg, strategy = plan.config, plan.strategy
    fixes = [f"perf.activation_checkpointing={m.value} (~{(state_bytes + estimate.under(m)) / GIB:.0f} GiB)"
             for m in (Recompute.selective, Recompute.full)
             if estimate.under(m) < estimate.under(mode) and state_bytes + estimate.under(m) <= holds][:1]
    # What grows with the micro-batch, from a second forward at a micro-batch of 1: some of what is kept does not
    # (on the CPU in fp32 the weights the backward reads), so the batch named is one this check passes.
    per_sample, fixed = estimate.under(mode) / micro, 0.0
    if micro > 1 and (single := activations(recipe, model, plan, micro=1)) is not None:
        per_sample = max(1.0, (estimate.under(mode) - single[0].under(mode)) / (micro - 1))
        fixed = max(0.0, single[0].under(mode) - per_sample)
    room = holds - state_bytes - fixed
    fitting = min(micro - 1, int(room // per_sample)) if room > 0 else 0
    if fitting >= 1:
        fixes.append(f"batch_size={fitting * strategy.world_size * strategy.accumulate} (a micro-batch of {fitting} "
                     "a rank)")
    if not fixes:
        fixes.append("a shorter recipe.context, a smaller model" + (", or more GPUs under strategy=fsdp" if plan.gpu_ids
                                                                   else ""))
    ranks = f" a rank, batch_size={cfg.batch_size} over {strategy.world_size} ranks" if strategy.world_size > 1 else ""
    raise LaunchError(f"recipe={cfg.recipe.name}: at a micro-batch of {micro}{ranks}, the activations the backward "
                      f"pass keeps come to ~{estimate.under(mode) / GIB:.1f} GiB a rank (perf.activation_checkpointing="
                      f"{mode.value}), beside ~{state_bytes / GIB:.1f} GiB of weights, gradients and optimizer state; "
                      f"{where}: {', or '.join(fixes)}")
