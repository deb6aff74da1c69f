"""torch.compile in a run: whether to compile (perf.compile), and where its caches live.

What is compiled (launcher/train/loop.py, step.py): with a captured step (perf.cuda_graph on a GPU)
the CUDA graph already removes the launch cost, so compiling is for fused kernels (BatchNorm
statistics, activations, casts, residual adds). The model's training-mode forward is compiled as one
graph (`compile_for_training`) and captured into the step's CUDA graph with the launcher's bucketed
all-reduce; the image augmentation and normalization are compiled as a second function (its random
numbers drawn eagerly before it), the loss stays eager inside the graph. Evaluation runs the
eager forward (a small share of a run, and compiling it would compile again for eval-mode BatchNorm
and each evaluation batch shape). Measured on 2x H200 and an H100, torch 2.11 (BENCHMARKS.md section 2):
one graph beat block-by-block compiles on ResNet-18 and by more on the fast net (fusion outweighs
letting each bucket's all-reduce start early). Normalization + network + loss as one graph, with the
augmentation compiled too, was slower for ResNet-18. Without a captured step the module that
trains is compiled as one would by hand (the DDP module, which dynamo splits at DDP's buckets).

Whether (perf.compile=auto): compiling costs time, most of it the first time a configuration is
compiled on a machine, less once inductor's caches hold its kernels. A short run does not earn that
back, so `auto` trains the first epoch uncompiled (no compile before the first step), measures it,
and compiles at the end of it only if the rest of the run would take long enough for compiling to
pay (`after_first_epoch`); the compile and capture then happen once, between epochs 1 and 2. The
bound (perf.compile_auto_min_s, 60 s) suits both CIFAR networks, whose compiled steps are shorter: a
cold compile is earned back after about a minute of uncompiled training (measured: BENCHMARKS.md
section 12). Both sides measured (bench/auto_rule.py): on an H100, ResNet-18 for 20 epochs ended sooner
uncompiled, as auto chose, and for 100 epochs sooner compiled after epoch 1, as auto chose (measured:
BENCHMARKS.md section 4).

The caches: inductor's FX-graph and AOT-autograd caches (and Triton's kernels) go to
~/.cache/launcher/inductor unless TORCHINDUCTOR_CACHE_DIR is set, so they outlive /tmp and are shared
by one user's runs (SLURM nodes with a shared home included).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import nn

from launcher.config import Toggle
from launcher.data.cache import inductor_dir, prepare_inductor_dir

cache_dir = inductor_dir  # where inductor's caches go: TORCHINDUCTOR_CACHE_DIR, else ~/.cache/launcher/inductor


def compiled(fn, mode: str | None, backend: str = "inductor"):
    """torch.compile(fn), with inductor's caches in the launcher's cache directory (every compile of a
    run goes through here, so the caches are where the module docstring says)."""
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:  # (launch sets it before it starts a worker; unset
        prepare_inductor_dir()  # in a process it did not start, or where the default could not be made)
    return torch.compile(fn, mode=mode, backend=backend)


@dataclass(frozen=True)
class Decision:
    compile: bool
    why: str  # one phrase, for the log and results.json
    pending: bool = False  # perf.compile=auto on a GPU: decided after the first epoch (`after_first_epoch`)


def decide(setting: Toggle, device_type: str) -> Decision:
    """perf.compile before the run: true and false are taken as said; auto waits for the first epoch's
    time on a GPU, and never compiles on the CPU."""
    if setting is Toggle.true:
        return Decision(True, "perf.compile=true")
    if setting is Toggle.false:
        return Decision(False, "perf.compile=false")
    if device_type != "cuda":
        return Decision(False, "perf.compile=auto: not on the CPU")
    return Decision(False, "perf.compile=auto: a run of one epoch", pending=True)


def after_first_epoch(epoch_s: float, epochs_left: int, min_seconds: float) -> Decision:
    """perf.compile=auto once the first epoch took `epoch_s`: compile when the epochs left would take
    at least `min_seconds` (perf.compile_auto_min_s) uncompiled. Compiling shortened the CIFAR networks'
    steps and took a while the first time a configuration was compiled on a machine (less from a warm
    cache; measured: BENCHMARKS.md section 12), so about a minute of training is where it starts to pay."""
    left_s = epoch_s * epochs_left
    if left_s >= min_seconds:
        return Decision(True, f"perf.compile=auto: the {epochs_left} epochs left would take ~{left_s:.0f}s "
                        f"uncompiled, at least {min_seconds:.0f}s")
    return Decision(False, f"perf.compile=auto: the {epochs_left} epochs left would take ~{left_s:.0f}s "
                    f"uncompiled, less than the {min_seconds:.0f}s that earn the compile time back")


def autotunes(setting: Toggle, decision: Decision) -> bool:
    """Whether cuDNN autotunes (perf.cudnn_benchmark): true and false as said; auto when the run compiles.
    Autotuning shortened the CIFAR networks' steps a little and delayed the first step (an H100, torch
    2.11; measured: BENCHMARKS.md section 4), the same trade as compiling on a smaller scale, so it follows
    the compile decision (with perf.compile=auto, from the second epoch of a run long enough to compile)."""
    return decision.compile if setting is Toggle.auto else setting is Toggle.true


def compile_for_training(model: nn.Module, mode: str | None, backend: str = "inductor") -> None:
    """Compile the model's forward for training, in place, as one graph: in training mode the model runs
    the compiled forward, in eval mode its own. The module and its state dict keys stay as they were."""
    eager = model.forward
    fast = compiled(eager, mode, backend)

    def forward(*args, **kwargs):
        return fast(*args, **kwargs) if model.training else eager(*args, **kwargs)

    model.forward = forward


def compiled_mode(value: str) -> str | None:
    """perf.compile_mode as torch.compile takes it (None for inductor's default)."""
    return None if value == "default" else value


def settle_heap() -> None:
    """After compiling: collect the garbage once, then freeze what lives (launcher/heap.py), so that no full
    collection walks the compiled code's objects again. Compiling leaves hundreds of thousands of them (a
    compiled ResNet-18: ~640,000, a walk the host notices; measured: BENCHMARKS.md section 12); without this a
    full collection, let loose by those new objects, can fall inside an early epoch and hold up a step the
    host is issuing, where the host sets the pace (a small network's compiled step). Reference counting frees
    frozen objects as ever; only cyclic garbage among them stays, until heap.release at the run's end."""
    from launcher import heap

    heap.freeze()
