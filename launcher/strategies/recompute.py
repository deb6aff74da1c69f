"""Activation checkpointing (`perf.activation_checkpointing`): each block's activations recomputed in the
backward pass instead of kept from the forward, under every strategy, compiled or not.

    none        everything the backward needs is kept (the fastest, the most memory)
    full        each block keeps only its input; its whole forward runs again in the backward
    selective   each block keeps the outputs of its matrix multiplications, attention and convolutions
                (the costly ops) and recomputes the rest (norms, activations, element-wise ops: most of
                the bytes, little of the time), per op, through torch.utils.checkpoint's selective policy

The blocks are the strategy's shard units (`shard_units`: the model's own list, its ModuleLists' members,
or its children with parameters): under fsdp the same modules are sharded one by one. Applied before the
strategy wraps the model; a block's parameters keep their names (checkpoints are the same either way).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

    from launcher.config import Config, Recompute


def mode_of(cfg: Config) -> Recompute:
    """The run's mode: perf.activation_checkpointing, or full where fsdp's older
    `strategy.activation_checkpointing=true` asks for it."""
    from launcher.config import Recompute

    mode = cfg.perf.activation_checkpointing
    if mode is Recompute.none and getattr(cfg.strategy, "activation_checkpointing", False):
        return Recompute.full
    return mode


def shard_units(model: nn.Module) -> list[nn.Module]:
    """The model's blocks: its own `shard_units()`, the modules of the classes a Hugging Face model names in
    `_no_split_modules` (its decoder layers), its ModuleLists' members, or its direct children that hold
    parameters (the units fsdp shards one by one, and those recomputed here)."""
    from torch import nn

    own = getattr(model, "shard_units", None)
    if callable(own):
        return list(own())
    whole = set(getattr(model, "_no_split_modules", None) or ())
    named = [(name, m) for name, m in model.named_modules() if name and type(m).__name__ in whole]
    outermost = [m for name, m in named if not any(name.startswith(f"{other}.") for other, _ in named)]
    if outermost:
        return outermost
    listed = [m for lst in model.modules() if isinstance(lst, nn.ModuleList) for m in lst]
    if listed:
        return listed
    return [child for child in model.children() if any(True for _ in child.parameters())]


def apply(model: nn.Module, mode: Recompute) -> str | None:
    """Recompute `model`'s blocks in the backward pass as `mode` says; what was done, in one line (None
    for none)."""
    from launcher.config import Recompute

    if mode is Recompute.none:
        return None
    blocks = shard_units(model)
    for block in blocks:
        recompute_in_backward(block, selective=mode is Recompute.selective)
    kept = ("matmul, attention and convolution outputs kept, the rest recomputed" if mode is Recompute.selective
            else "each block's input kept, its forward run again")
    return f"activation checkpointing: {mode.value}, {len(blocks)} block{'s' if len(blocks) != 1 else ''} ({kept})"


def recompute_in_backward(module: nn.Module, selective: bool = False) -> None:
    """The module's forward runs under torch.utils.checkpoint (non-reentrant): its activations are not kept
    for the backward pass but recomputed there, all of them, or (selective) all but the costly ops'
    outputs. `_recomputed_forward` is the forward itself, what fsdp compiles per block."""
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    module._recomputed_forward = module.forward
    contexts = functools.partial(create_selective_checkpoint_contexts, _keep_costly) if selective else None

    def checkpointed(*args: Any, **kwargs: Any) -> Any:
        if contexts is None:
            return checkpoint(module._recomputed_forward, *args, use_reentrant=False, **kwargs)
        return checkpoint(module._recomputed_forward, *args, use_reentrant=False, context_fn=contexts, **kwargs)

    module.forward = checkpointed


def _keep_costly(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    """The selective policy: an op whose output is costly to compute again (a matmul, attention, a
    convolution) has it kept; any other is recomputed."""
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if op in _costly_ops() else CheckpointPolicy.PREFER_RECOMPUTE


@functools.cache
def _costly_ops() -> frozenset:
    import torch

    aten = torch.ops.aten
    names = ("mm", "addmm", "bmm", "baddbmm", "convolution", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
             "_scaled_dot_product_flash_attention_for_cpu", "_flash_attention_forward", "_efficient_attention_forward")
    return frozenset(getattr(aten, name).default for name in names if hasattr(aten, name))
