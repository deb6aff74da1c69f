"""Optimizers and learning-rate schedules the trainer builds from the `optim` group.

- sgd / adamw: one optimizer over all parameters, a linear warm-up, then a linear or cosine decay.
- muon: Muon for the model's filter matrices (torch.optim.Muon's update, in the capturable form below),
  Nesterov SGD for everything else, as in Keller Jordan's CIFAR-10 speed records. The model says which
  parameters are which through `parameter_roles()` (see recipes/vision_models.py); each role gets its
  own learning rate.
To add an optimizer: its schema in launcher/config.py, conf/optim/<name>.yaml, and its builder in BUILDERS.

A schedule is a function of the step returning a multiplier of each group's base learning rate; the
trainer wraps every optimizer in a LambdaLR so schedules are checkpointed with the run.

On a GPU every optimizer here runs its fused implementation (one kernel over all parameters, where the
default foreach one makes several passes over weights, gradients and state: for a GPT of 86M parameters
on an H100 that was a noticeable part of the step; measured: BENCHMARKS.md section 12), except SGD over
fsdp's sharded parameters, which torch cannot fuse (`sgd_can_fuse`).

Every optimizer here can also be captured in a CUDA graph with the step (`capturable`; launcher/train/
step.py): no host sync in its step, and a learning rate that may be a device tensor, which the step
fills from the schedule's value before each replay.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from launcher.config import AdamWConfig, Decay, MuonConfig, OptimConfig, SGDConfig
from launcher.errors import ConfigError

Schedule = Callable[[int], float]


def warmup_length(total_steps: int, warmup_steps: int) -> int:
    """The warm-up's steps as the schedule takes them: none below 0, and at least one step left to decay."""
    return min(max(warmup_steps, 0), total_steps - 1)


def warmup_then_decay(total_steps: int, warmup_steps: int, decay: Decay = Decay.linear,
                      floor: float = 0.0) -> Schedule:
    """LR multiplier: a linear warm-up from ~0 to 1 over warmup_steps, then a linear or cosine decay to
    `floor` at total_steps, where it stays."""
    warmup_steps = warmup_length(total_steps, warmup_steps)

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        left = max(0.0, (total_steps - step) / max(1, total_steps - warmup_steps))  # 1 after the warm-up, 0 at the end
        shape = left if decay is Decay.linear else 0.5 * (1 - math.cos(math.pi * left))
        return floor + (1 - floor) * shape

    return factor


def describe(o: OptimConfig, lr: float, epochs: int, steps_per_epoch: int) -> str:
    """The optimizer and its schedule in one line, in steps (the worker logs it: the metrics hold the
    learning rate at each epoch's end only)."""
    total = epochs * steps_per_epoch
    warmup = warmup_length(total, round(o.warmup_epochs * steps_per_epoch))
    rise = f"a linear warm-up over {warmup} steps, then " if warmup > 0 else ""
    return (f"optim: {o.name}, lr {lr:g}: {rise}a {o.decay.value} decay to {lr * o.min_lr_ratio:g} at step {total} "
            f"({epochs} epochs of {steps_per_epoch} steps)")


def schedule_of(o: OptimConfig, total: int, steps_per_epoch: int) -> Schedule:
    """The `optim` group's schedule for a run of `total` steps."""
    return warmup_then_decay(total, round(o.warmup_epochs * steps_per_epoch), o.decay, o.min_lr_ratio)


def linear_decay(total_steps: int) -> Schedule:
    """1 at the first step, falling linearly to 0 at `total_steps` and staying there."""

    def factor(step: int) -> float:
        return max(0.0, 1.0 - step / max(1, total_steps))

    return factor


@dataclass
class Stepper:
    """An optimizer and its schedule, stepped together."""

    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR

    def step(self) -> None:
        self.optimizer.step()
        self.scheduler.step()


@dataclass(frozen=True)
class Settings:
    """An optimizer's hyper-parameters per parameter group (lr, momentum, weight decay, ...) and its
    schedule's base learning rates: what a run's config decides, as opposed to its training state."""

    groups: list[dict]
    base_lrs: list[float]


def settings(steppers: list[Stepper]) -> list[Settings]:
    return [Settings([{k: v for k, v in g.items() if k != "params"} for g in s.optimizer.param_groups],
                     list(s.scheduler.base_lrs)) for s in steppers]


def continue_with(steppers: list[Stepper], wanted: list[Settings], step: int) -> None:
    """After a checkpoint was loaded (its optimizer state and schedule, and with them the hyper-parameters
    of the run that wrote it): put this run's hyper-parameters back and place the schedule at `step`
    (the epochs done x this run's steps per epoch), so the learning rate is this run's schedule there."""
    for stepper, want in zip(steppers, wanted, strict=True):
        sched = stepper.scheduler
        for group, values in zip(stepper.optimizer.param_groups, want.groups, strict=True):
            group.update(values)
        sched.base_lrs = list(want.base_lrs)
        sched.last_epoch = step
        sched._step_count = step + 1  # (LambdaLR counts its own steps; keeps its order warning quiet)
        for group, base, factor in zip(stepper.optimizer.param_groups, sched.base_lrs, sched.lr_lambdas, strict=True):
            group["lr"] = base * factor(step)
        sched._last_lr = [g["lr"] for g in stepper.optimizer.param_groups]


def _stepper(optimizer: torch.optim.Optimizer, schedules: Schedule | list[Schedule]) -> Stepper:
    return Stepper(optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedules))


def build(options: OptimConfig, lr: float, epochs: int, model: nn.Module, steps_per_epoch: int,
          fused: bool, graphed: bool = False) -> list[Stepper]:
    """The run's optimizers, each with its schedule; the first one's LR is the one logged. `graphed`:
    their steps will be captured in a CUDA graph (AdamW then keeps its step counts on the device)."""
    steppers = BUILDERS[type(options)](options, lr, epochs * steps_per_epoch, model, steps_per_epoch, fused)
    if graphed:
        for stepper in steppers:
            groups = stepper.optimizer.param_groups
            if any("capturable" in g for g in groups):
                for group in groups:
                    group["capturable"] = True
                # (the warm-up's eager steps run it uncaptured on purpose: torch's warning that
                # capturable=True "can impair performance" when never captured would mislead)
                stepper.optimizer._warned_capturable_if_run_uncaptured = True
    return steppers


def capturable(optimizer: torch.optim.Optimizer) -> bool:
    """Whether a CUDA graph can hold `optimizer.step()` with the learning rate as a device tensor:
    fused SGD and AdamW (AdamW with capturable=True), and this module's Muon."""
    if isinstance(optimizer, Muon):
        return True
    groups = optimizer.param_groups
    if isinstance(optimizer, torch.optim.SGD):
        return all(g.get("fused") for g in groups)
    if isinstance(optimizer, torch.optim.AdamW):
        return all(g.get("fused") and g.get("capturable") for g in groups)
    return False


def sgd_can_fuse(params: Any) -> bool:
    """Whether fused SGD can step these parameters: not where any is a DTensor (fsdp's shards), for which
    torch's DTensor has no rule for the fused kernel (its step raises NotImplementedError); there SGD runs
    its foreach implementation. (Fused AdamW has one.)"""
    from torch.distributed.tensor import DTensor
    groups = params if params and isinstance(params[0], dict) else [{"params": params}]
    return not any(isinstance(p, DTensor) for g in groups for p in g["params"])


def _sgd(o: SGDConfig, lr: float, total: int, model: nn.Module, steps_per_epoch: int, fused: bool) -> list[Stepper]:
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=lr, momentum=o.momentum, nesterov=o.nesterov and o.momentum > 0,
                          weight_decay=o.weight_decay, fused=(fused and sgd_can_fuse(params)) or None)
    return [_stepper(opt, schedule_of(o, total, steps_per_epoch))]


def _adamw(o: AdamWConfig, lr: float, total: int, model: nn.Module, steps_per_epoch: int,
           fused: bool) -> list[Stepper]:
    params: Any = list(model.parameters())
    if not o.decay_1d:  # (nanoGPT's groups: matrices and embeddings decay, biases and norms' gains do not)
        params = [{"params": [p for p in params if p.dim() >= 2]},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(params, lr=lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay,
                            fused=fused or None)
    return [_stepper(opt, schedule_of(o, total, steps_per_epoch))]


ROLES = ("matrices", "biases", "stem_bias", "head")  # what muon's groups take (`_muon_and_sgd`)


def parameter_roles(model: nn.Module, cfg: Any = None) -> dict[str, list[nn.Parameter]]:
    """Which of the model's parameters Muon takes (its `parameter_roles()`): every trained parameter in one
    role. ConfigError without one, or where a trained parameter is in none (it would never be stepped) or
    in two (stepped twice)."""
    roles = getattr(model, "parameter_roles", None)
    which = (f"recipe={cfg.recipe.name}'s model {cfg.recipe.model}" if cfg is not None
             else f"the model {type(model).__name__}")
    if roles is None:
        raise ConfigError("optim", "muon", f"{which} does not say which of its parameters are filter matrices (it "
                          "has no parameter_roles()); use optim=sgd or optim=adamw with it, or Muon with a model "
                          "that does", "recipe=cifar10_fast optim=muon")
    found = roles()
    names = {id(p): name for name, p in model.named_parameters()}
    placed: dict[int, str] = {}
    twice = []
    for role in ROLES:
        for param in found.get(role, []):
            if id(param) in placed:
                twice.append(f"{names.get(id(param), '?')} ({placed[id(param)]} and {role})")
            placed[id(param)] = role
    left_out = [name for name, p in model.named_parameters() if p.requires_grad and id(p) not in placed]
    if left_out or twice or not found.get("matrices"):
        what = (f"leaves {', '.join(left_out[:5])} in no role (never trained)" if left_out else
                f"names {', '.join(twice[:5])} twice (stepped twice)" if twice else "names no matrices")
        raise ConfigError("optim", "muon", f"{which}'s parameter_roles() {what}: it must put each trained parameter "
                          f"in one of {', '.join(ROLES)}, and name the matrices; or use optim=sgd or optim=adamw "
                          "with it", "recipe=cifar10_fast optim=muon")
    return found


def _muon_and_sgd(o: MuonConfig, lr: float, total: int, model: nn.Module, steps_per_epoch: int,
                  fused: bool) -> list[Stepper]:
    """Muon on the filter matrices; Nesterov SGD on biases, the head and the stem's bias.

    `lr` is Muon's learning rate. The SGD groups take `optim.sgd_lr` (norm biases, the stem bias) and
    `optim.head_lr` (the classifier), and `optim.weight_decay` is the decay per step at full LR
    (SGD's coupled decay is divided by each group's LR so that LR x decay stays that number).
    The stem's bias trains only for `optim.stem_bias_epochs` epochs, then its LR is 0.
    """
    roles = parameter_roles(model)
    schedule = schedule_of(o, total, steps_per_epoch)
    sgd_groups, schedules = [], []
    for role, group_lr in (("stem_bias", o.sgd_lr), ("biases", o.sgd_lr), ("head", o.head_lr)):
        if roles.get(role):
            sgd_groups.append({"params": roles[role], "lr": group_lr, "weight_decay": o.weight_decay / group_lr})
            schedules.append(linear_decay(round(o.stem_bias_epochs * steps_per_epoch)) if role == "stem_bias"
                             else schedule)
    sgd = torch.optim.SGD(sgd_groups, momentum=o.momentum, nesterov=True,
                          fused=(fused and sgd_can_fuse(sgd_groups)) or None)
    muon = Muon(roles["matrices"], lr=lr, momentum=o.muon_momentum, nesterov=True, weight_decay=0.0)
    keep_unit_rms(muon, roles["matrices"])
    return [_stepper(muon, schedule), _stepper(sgd, schedules)]  # the first one's LR is the one logged


def keep_unit_rms(optimizer: torch.optim.Optimizer, matrices: list[nn.Parameter]) -> None:
    """Rescale each matrix to norm sqrt(rows) now and after every step of `optimizer`.

    The filters feed BatchNorm, so their scale does not change the function; fixing it keeps Muon's
    fixed-size orthogonal updates a constant relative step instead of one that shrinks as the weights
    grow (the speed records normalize the same way before each update).
    """

    @torch.no_grad()
    def normalize(*_) -> None:
        scale = torch._foreach_reciprocal(torch._foreach_clamp_min(torch._foreach_norm(matrices), 1e-12))
        torch._foreach_mul_(scale, targets)
        torch._foreach_mul_(matrices, scale)

    targets = [len(p) ** 0.5 for p in matrices]

    normalize()
    optimizer.register_step_post_hook(normalize)


class Muon(torch.optim.Optimizer):
    """torch.optim.Muon's update, in a form a CUDA graph can capture and with fewer, larger kernels.

    The same algorithm, state and param_groups as torch.optim.Muon (so either one's checkpoints load
    into the other): momentum with Nesterov, the quintic Newton-Schulz orthogonalization in bf16 (in
    float32 on the CPU: `ns_dtype`) on the wide side of each matrix, decoupled weight decay, the
    "original" (or "match_rms_adamw") scaling of the learning rate by the matrix's shape. What differs
    is how: torch.optim.Muon takes the learning rate to the host (a tensor's `.item()`, which a graph
    cannot hold) and runs ~22 kernels per matrix; here the learning rate may stay a device tensor,
    momentum is one foreach kernel over all matrices, and the matrices are orthogonalized together in
    batched matmuls (`_batches`). In bf16 the numbers agree with torch.optim.Muon's to bf16 rounding
    (tests/unit/test_fast_recipe_parts.py).
    """

    def __init__(self, params, lr: float | torch.Tensor = 1e-3, weight_decay: float = 0.1, momentum: float = 0.95,
                 nesterov: bool = True, ns_coefficients: tuple[float, float, float] = (3.4445, -4.7750, 2.0315),
                 eps: float = 1e-7, ns_steps: int = 5, adjust_lr_fn: str | None = None):
        if not 0.0 <= float(lr) or not 0.0 <= momentum or not 0.0 <= weight_decay:
            raise ValueError(f"Muon: lr, momentum and weight_decay must be >= 0 (got {lr}, {momentum}, {weight_decay})")
        if adjust_lr_fn not in (None, "original", "match_rms_adamw"):
            raise ValueError(f"Muon: adjust_lr_fn must be original or match_rms_adamw, not {adjust_lr_fn}")
        defaults = {"lr": lr, "weight_decay": weight_decay, "momentum": momentum, "nesterov": nesterov,
                    "ns_coefficients": ns_coefficients, "eps": eps, "ns_steps": ns_steps, "adjust_lr_fn": adjust_lr_fn}
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim != 2:
                    raise ValueError(f"Muon takes matrices (2-D parameters), not a parameter of shape {tuple(p.shape)}")

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            grads = [p.grad for p in params]
            bufs = []
            for p in params:
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
                bufs.append(state["momentum_buffer"])
            momentum, lr, decay = group["momentum"], group["lr"], group["weight_decay"]
            torch._foreach_lerp_(bufs, grads, 1 - momentum)
            updates = torch._foreach_lerp(grads, bufs, momentum) if group["nesterov"] else bufs
            if decay:
                torch._foreach_mul_(params, 1 - lr * decay)
            # (padding pays on a GPU, where the small matmuls' launches cost more than their work; on the
            # CPU the work dominates: 2 cores took longer padded than by shape, in bf16; measured:
            # BENCHMARKS.md section 12)
            waste = 2.0 if params[0].is_cuda else 1.0
            for members, size in _batches([p.shape for p in params], waste):
                ortho = _orthogonalized([updates[i] for i in members], size, group).float().mul_(-lr)
                views = [_unpadded(o, params[i].shape) for o, i in zip(ortho.unbind(0), members, strict=True)]
                ratios = [_lr_ratio(params[i].shape, group["adjust_lr_fn"]) for i in members]
                if any(r != 1.0 for r in ratios):
                    torch._foreach_mul_(views, ratios)
                torch._foreach_add_([params[i] for i in members], views)
        return loss


def _wide(shape: torch.Size) -> tuple[int, int]:
    """A matrix's shape as orthogonalized: on its wide side (torch.optim.Muon transposes tall ones)."""
    return (shape[1], shape[0]) if shape[0] > shape[1] else (shape[0], shape[1])


def _batches(shapes: list[torch.Size], waste: float = 2.0) -> list[tuple[list[int], tuple[int, int]]]:
    """Which matrices are orthogonalized together, and the (rows, cols) each batch is padded to.

    Zero rows and columns pass through Newton-Schulz as zeros (the iteration is X times a polynomial
    of X^T X) and leave the norm alone, so matrices of different shapes can share one batch padded
    to the largest: all of a group's matrices at once while that costs at most `waste` times their
    own elements (airbench94's six: 1.8x, 15 batched matmuls instead of 90 small ones), else one
    batch per shape. With waste 1, one batch per shape.
    """
    wide = [_wide(s) for s in shapes]
    rows, cols = max(r for r, _ in wide), max(c for _, c in wide)
    if len(shapes) * rows * cols <= waste * sum(r * c for r, c in wide):
        return [(list(range(len(shapes))), (rows, cols))]
    by_shape: dict[tuple[int, int], list[int]] = {}
    for i, w in enumerate(wide):
        by_shape.setdefault(w, []).append(i)
    return [(members, size) for size, members in by_shape.items()]


def ns_dtype(device: torch.device) -> torch.dtype:
    """Newton-Schulz runs in bf16 on GPUs, as torch.optim.Muon runs it; in float32 on the CPU, where bf16
    matmuls are many times slower (2 cores, airbench94's three largest matrices; measured: BENCHMARKS.md
    section 12) and the iteration is no worse for the extra precision."""
    return torch.float32 if device.type == "cpu" else torch.bfloat16


def _orthogonalized(updates: list[torch.Tensor], size: tuple[int, int], group: dict) -> torch.Tensor:
    """Newton-Schulz (in `ns_dtype`), as torch.optim.Muon computes it, on a batch of matrices: each on
    its wide side, zero-padded to `size`. Returns the (k, *size) batch."""
    a, b, c = group["ns_coefficients"]
    wide = [u.mT if u.size(0) > u.size(1) else u for u in updates]
    dtype = ns_dtype(wide[0].device)
    if all(tuple(w.shape) == size for w in wide):
        x = torch.stack(wide).to(dtype)
    else:
        x = wide[0].new_zeros((len(wide), *size), dtype=dtype)
        for slot, w in zip(x.unbind(0), wide, strict=True):
            slot[:w.size(0), :w.size(1)].copy_(w)
    x = x / torch.linalg.vector_norm(x, dim=(1, 2), keepdim=True).clamp_(min=group["eps"])
    for _ in range(group["ns_steps"]):
        gram = torch.bmm(x, x.mT)
        gram = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.baddbmm(x, gram, x, beta=a)
    return x


def _unpadded(ortho: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """One matrix's update out of its padded, wide-side slot, in the parameter's own shape."""
    rows, cols = _wide(shape)
    view = ortho[:rows, :cols]
    return view.mT if shape[0] > shape[1] else view


def _lr_ratio(shape: torch.Size, adjust_lr_fn: str | None) -> float:
    rows, cols = shape[:2]
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    return math.sqrt(max(1.0, rows / cols))


BUILDERS: dict[type[OptimConfig], Callable[..., list[Stepper]]] = {
    SGDConfig: _sgd,
    AdamWConfig: _adamw,
    MuonConfig: _muon_and_sgd,
}


def state_per_parameter(options: OptimConfig) -> int:
    """How many tensors of a parameter's size the optimizer keeps for it (OptimConfig.state_copies)."""
    return options.state_copies
