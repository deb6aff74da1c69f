"""Optimizers and learning-rate schedules the trainer builds from the `optim` group.

- sgd / adamw: one optimizer over all parameters, triangular schedule (linear warm-up, linear decay).
- muon: torch.optim.Muon for the model's filter matrices, Nesterov SGD for everything else, as in
  Keller Jordan's CIFAR-10 speed records. The model says which parameters are which through
  `parameter_roles()` (see recipes/vision_models.py); each role gets its own learning rate.
To add an optimizer: its schema in launcher/config.py, conf/optim/<name>.yaml, and its builder in BUILDERS.

A schedule is a function of the step returning a multiplier of each group's base learning rate; the
trainer wraps every optimizer in a LambdaLR so schedules are checkpointed with the run.

On a GPU every optimizer here runs its fused implementation (one kernel over all parameters, where the
default foreach one makes several passes over weights, gradients and state: for a GPT of 86M parameters
on an H100 that was ~7% of the step, bench/results/gpt-compare-*).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from launcher.config import AdamWConfig, MuonConfig, OptimConfig, SGDConfig
from launcher.errors import ConfigError

Schedule = Callable[[int], float]


def triangular_schedule(total_steps: int, warmup_steps: int) -> Schedule:
    """LR multiplier: linear warm-up from ~0 to 1 over warmup_steps, then linear decay to 0 at the end."""
    warmup_steps = min(max(warmup_steps, 0), total_steps - 1)

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        return max(0.0, (total_steps - step) / max(1, total_steps - warmup_steps))

    return factor


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
          fused: bool) -> list[Stepper]:
    """The run's optimizers, each with its schedule; the first one's LR is the one logged."""
    return BUILDERS[type(options)](options, lr, epochs * steps_per_epoch, model, steps_per_epoch, fused)


def _sgd(o: SGDConfig, lr: float, total: int, model: nn.Module, steps_per_epoch: int, fused: bool) -> list[Stepper]:
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=o.momentum, nesterov=o.nesterov and o.momentum > 0,
                          weight_decay=o.weight_decay, fused=fused or None)
    return [_stepper(opt, triangular_schedule(total, round(o.warmup_epochs * steps_per_epoch)))]


def _adamw(o: AdamWConfig, lr: float, total: int, model: nn.Module, steps_per_epoch: int,
           fused: bool) -> list[Stepper]:
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=o.weight_decay, fused=fused or None)
    return [_stepper(opt, triangular_schedule(total, round(o.warmup_epochs * steps_per_epoch)))]


def parameter_roles(model: nn.Module) -> dict[str, list[nn.Parameter]]:
    roles = getattr(model, "parameter_roles", None)
    if roles is None:
        raise ConfigError("optim", "muon", f"the model {type(model).__name__} does not say which of its "
                          "parameters are filter matrices (parameter_roles()); use optim=sgd", "recipe=cifar10_fast")
    return roles()


def _muon_and_sgd(o: MuonConfig, lr: float, total: int, model: nn.Module, steps_per_epoch: int,
                  fused: bool) -> list[Stepper]:
    """Muon on the filter matrices; Nesterov SGD on biases, the head and the stem's bias.

    `lr` is Muon's learning rate. The SGD groups take `optim.sgd_lr` (norm biases, the stem bias) and
    `optim.head_lr` (the classifier), and `optim.weight_decay` is the decay per step at full LR
    (SGD's coupled decay is divided by each group's LR so that LR x decay stays that number).
    The stem's bias trains only for `optim.stem_bias_epochs` epochs, then its LR is 0.
    """
    roles = parameter_roles(model)
    schedule = triangular_schedule(total, round(o.warmup_epochs * steps_per_epoch))
    sgd_groups, schedules = [], []
    for role, group_lr in (("stem_bias", o.sgd_lr), ("biases", o.sgd_lr), ("head", o.head_lr)):
        if roles.get(role):
            sgd_groups.append({"params": roles[role], "lr": group_lr, "weight_decay": o.weight_decay / group_lr})
            schedules.append(linear_decay(round(o.stem_bias_epochs * steps_per_epoch)) if role == "stem_bias"
                             else schedule)
    sgd = torch.optim.SGD(sgd_groups, momentum=o.momentum, nesterov=True, fused=fused)
    muon = torch.optim.Muon(roles["matrices"], lr=lr, momentum=o.muon_momentum, nesterov=True, weight_decay=0.0)
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


BUILDERS: dict[type[OptimConfig], Callable[..., list[Stepper]]] = {
    SGDConfig: _sgd,
    AdamWConfig: _adamw,
    MuonConfig: _muon_and_sgd,
}
