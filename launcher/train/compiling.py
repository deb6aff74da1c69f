"""torch.compile in a run: whether to compile (perf.compile=auto), what to compile, and where its cache lives.

What: with a captured step (perf.cuda_graph on a GPU) the CUDA graph already removes the launch cost,
so what compiling adds is fused kernels (BatchNorm statistics, activations, casts, residual adds).
The model's compile units are compiled one by one (`compile_units()` on the model, else the whole
model): each unit's backward pass is then its own autograd node, so the gradients of the last units
are complete while earlier units still run backward, and their buckets' all-reduce starts early
(launcher/train/step.py, FlatGradients), as it does without compiling. Compiling the whole model as
one graph would deliver every gradient at the very end and serialize the all-reduce after it.
Without a captured step the module that trains is compiled as torch.compile would be used by hand
(the DDP module, which dynamo splits at DDP's buckets).

Whether (perf.compile=auto): compiling costs time before the first step: tens of seconds the first
time a configuration is compiled on a machine, a few seconds once inductor's caches hold its kernels.
A short run does not earn that back, so `auto` compiles only runs long enough to (ShouldCompile).

The cache: inductor's FX-graph and AOT-autograd caches (and Triton's kernels under them) go to
~/.cache/launcher/inductor unless TORCHINDUCTOR_CACHE_DIR is set, so they outlive /tmp and are shared
by the runs of one user (SLURM nodes with a shared home included).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

# perf.compile=auto compiles a run of at least this many training steps on a GPU (BENCHMARKS.md,
# "Compile or not": where the compile time is earned back, cold and with warm caches).
AUTO_MIN_STEPS = 4000


def cache_dir(env: os._Environ | dict[str, str] = os.environ) -> Path:
    """Where inductor's caches go: TORCHINDUCTOR_CACHE_DIR, else ~/.cache/launcher/inductor."""
    if env.get("TORCHINDUCTOR_CACHE_DIR"):
        return Path(env["TORCHINDUCTOR_CACHE_DIR"])
    home = Path(env.get("XDG_CACHE_HOME") or Path(env.get("HOME") or Path.home()) / ".cache")
    return home / "launcher" / "inductor"


def use_persistent_cache() -> None:
    """Point inductor at the launcher's cache directory (before anything compiles)."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir()))


@dataclass(frozen=True)
class Decision:
    compile: bool
    why: str  # one phrase, for the log and results.json


def decide(setting: bool | str, device_type: str, total_steps: int, min_steps: int = AUTO_MIN_STEPS) -> Decision:
    """perf.compile as a decision for this run: true and false are taken as said; auto compiles GPU
    runs of at least `min_steps` training steps."""
    if setting is True:
        return Decision(True, "perf.compile=true")
    if setting is False:
        return Decision(False, "perf.compile=false")
    if device_type != "cuda":
        return Decision(False, "perf.compile=auto: not on the CPU")
    if total_steps < min_steps:
        return Decision(False, f"perf.compile=auto: {total_steps} steps, fewer than the {min_steps} that earn "
                        "the compile time back")
    return Decision(True, f"perf.compile=auto: {total_steps} steps, at least {min_steps}")


def compile_units(model: nn.Module) -> list[nn.Module]:
    """The modules to compile one by one: the model's `compile_units()` if it has one, else the model."""
    units = getattr(model, "compile_units", None)
    if os.environ.get("LAUNCH_PROBE_COMPILE_WHOLE") == "1":  # (probe only: removed after measuring)
        return [model]
    return list(units()) if callable(units) else [model]


def compile_for_training(model: nn.Module, mode: str | None) -> int:
    """Compile each of the model's units for training, in place: a unit in training mode runs its
    compiled forward, in eval mode its own (evaluation is a small share of a run and would otherwise
    compile every unit again for eval-mode BatchNorm and each evaluation batch shape). The modules and
    their state dict keys stay as they were. Returns how many units were compiled."""
    units = compile_units(model)
    for unit in units:
        eager = unit.forward
        fast = torch.compile(eager, mode=mode)

        def forward(*args, _unit=unit, _fast=fast, _eager=eager, **kwargs):
            return _fast(*args, **kwargs) if _unit.training else _eager(*args, **kwargs)

        unit.forward = forward
    return len(units)


def compiled_mode(value: str) -> str | None:
    """perf.compile_mode as torch.compile takes it (None for inductor's default)."""
    return None if value == "default" else value


def reset() -> None:
    """Forget compiled code (tests that compile several models in one process)."""
    torch._dynamo.reset()
