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

import dataclasses
import functools
from collections.abc import Callable
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
    names = ("mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "convolution", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
             "_scaled_dot_product_flash_attention_for_cpu", "_flash_attention_forward", "_efficient_attention_forward")
    return frozenset(getattr(aten, name).default for name in names if hasattr(aten, name))


@dataclasses.dataclass(frozen=True)
class Activations:
    """Bytes one rank keeps for its backward pass at one micro-batch, under each mode (`activation_bytes`)."""

    none: int
    full: int
    selective: int

    def under(self, mode: Recompute) -> int:
        return getattr(self, mode.value)


def activation_bytes(model: nn.Module, forward: Callable[[], Any]) -> Activations:
    """What the backward pass needs kept, measured by one forward (`forward()`: the training step of `model` on a
    batch) with the model and the batch on the meta device (shapes only: no memory, no arithmetic) and no block
    recomputed. Every tensor autograd saves is counted once (by its storage), as saved inside a block or outside:

    - none: all of them;
    - full: those outside the blocks, each block's input, and one block's own (rebuilt while its backward runs);
    - selective: full's, and the outputs of the costly ops inside the blocks (what its policy keeps).

    Attention is counted as a fused kernel keeps it (inputs, output, log-sum-exp), not as the meta device runs
    it (unfused math that keeps a sequence x sequence matrix), and a block's input as its tensor arguments."""
    import torch
    import torch.nn.functional as F
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    inside: int | None = None  # the block running now (its index), None outside every block
    saved: dict[Any, tuple[int | None, int]] = {}  # storage -> (block or None, bytes)
    inputs: dict[Any, int] = {}
    costly: dict[Any, int] = {}

    def counted(tensor: torch.Tensor) -> tuple[Any, int]:
        storage = tensor.untyped_storage()
        return storage._cdata, storage.nbytes()

    def pack(tensor: Any) -> Any:
        if isinstance(tensor, torch.Tensor):
            key, size = counted(tensor)
            saved.setdefault(key, (inside, size))
        return tensor

    def keep_costly(*outputs: torch.Tensor) -> None:
        if inside is not None:
            for tensor in outputs:
                key, size = counted(tensor)
                costly[key] = size

    class FusedAttention(torch.autograd.Function):
        """Scaled dot-product attention as a fused kernel saves it, shapes only."""

        @staticmethod
        def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            out = q.new_empty((*q.shape[:-1], v.shape[-1]))
            logsumexp = q.new_empty(q.shape[:-1], dtype=torch.float32)
            ctx.save_for_backward(q, k, v, out, logsumexp)
            keep_costly(out, logsumexp)
            return out

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> Any:  # (never run: the count needs no backward)
            q, k, v, _, _ = ctx.saved_tensors
            return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)

    class Attention(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if func is F.scaled_dot_product_attention:
                return FusedAttention.apply(*args[:3])
            return func(*args, **(kwargs or {}))

    class Costly(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            out = func(*args, **(kwargs or {}))
            if func in _costly_ops():
                keep_costly(*(o for o in (out if isinstance(out, (tuple, list)) else (out,))
                              if isinstance(o, torch.Tensor)))
            return out

    def enter(index: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple) -> None:
            nonlocal inside
            inside = index
            for arg in args:
                if isinstance(arg, torch.Tensor):
                    key, size = counted(arg)
                    inputs[key] = size
        return hook

    def leave(module: nn.Module, args: tuple, output: Any) -> None:
        nonlocal inside
        inside = None

    handles = []
    for index, block in enumerate(shard_units(model)):
        handles += [block.register_forward_pre_hook(enter(index)), block.register_forward_hook(leave)]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), Attention(), Costly():
            forward()
    finally:
        for handle in handles:
            handle.remove()
    outside = sum(size for block, size in saved.values() if block is None)
    per_block: dict[int, int] = {}
    for block, size in saved.values():
        if block is not None:
            per_block[block] = per_block.get(block, 0) + size
    full = outside + sum(inputs.values()) + max(per_block.values(), default=0)
    none = outside + sum(per_block.values())
    return Activations(none=none, full=min(full, none), selective=min(full + sum(costly.values()), none))
