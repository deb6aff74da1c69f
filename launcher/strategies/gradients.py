"""Flat gradients: how a captured step's gradients are kept and averaged across ranks (the strategies'
gradient sync where DDP's reducer cannot run: a replayed CUDA graph runs none of its host-side code).

Strategy.wrap makes them (base.py: one device; ddp.py's CapturedDDP: averaged over the ranks), the
training step (launcher/train/step.py) zeroes them and calls start_backward/finish_backward around
each backward pass.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist


class FlatGradients:
    """Every trainable parameter's `.grad` as a view into one flat buffer per dtype, averaged across
    ranks in buckets while the backward pass still runs.

    Zeroing is one kernel per dtype. Parameters are laid out in reverse order (the last layers' grads
    are ready first), cut into buckets of about `bucket_mb`; a post-accumulate-grad hook counts each
    bucket's parameters and, once a bucket and all before it are complete, starts its all-reduce.
    Buckets therefore start in the same order on every rank, the way DDP orders them. Under capture
    the hooks run once and the all-reduces land in the graph where the hooks fired, so replays overlap
    communication with the rest of the backward pass as well. Each view keeps its parameter's strides
    (channels_last filters included), since autograd accumulates into it.
    """

    def __init__(self, params: Iterable[torch.nn.Parameter], world_size: int = 1, bucket_mb: float = 25.0):
        self.world_size = world_size
        trainable = [p for p in params if p.requires_grad][::-1]
        for p in trainable:
            if not _dense(p):
                raise ValueError(f"a parameter of shape {tuple(p.shape)} is not dense in memory; "
                                 "flat gradients need dense parameters")
        by_dtype: dict[torch.dtype, list[torch.nn.Parameter]] = {}
        for p in trainable:
            by_dtype.setdefault(p.dtype, []).append(p)
        self.buffers: list[torch.Tensor] = []
        self.buckets: list[torch.Tensor] = []  # slices of the buffers, in the order they are reduced
        self._bucket_of: dict[torch.nn.Parameter, int] = {}
        self._members: list[int] = []
        cap = max(1, int(bucket_mb * 2**20))
        for dtype, group in by_dtype.items():
            flat = torch.zeros(sum(p.numel() for p in group), dtype=dtype, device=group[0].device)
            self.buffers.append(flat)
            start = offset = members = 0
            for i, p in enumerate(group):
                p.grad = flat.as_strided(p.shape, p.stride(), offset)
                self._bucket_of[p] = len(self.buckets)
                offset += p.numel()
                members += 1
                if (offset - start) * flat.element_size() >= cap or i == len(group) - 1:
                    self.buckets.append(flat[start:offset])
                    self._members.append(members)
                    start, members = offset, 0
        self.views = {p: p.grad for p in trainable}  # what each .grad must stay (nothing may set it to None)
        self._pending: list[int] = []
        self._works: list = []
        self._launched = 0
        if world_size > 1:
            for p in trainable:
                p.register_post_accumulate_grad_hook(self._grad_ready)

    def zero(self) -> None:
        for flat in self.buffers:
            flat.zero_()

    def start_backward(self) -> None:
        self._pending = list(self._members)
        self._works = []
        self._launched = 0

    def _grad_ready(self, p: torch.nn.Parameter) -> None:
        self._pending[self._bucket_of[p]] -= 1
        while self._launched < len(self.buckets) and self._pending[self._launched] == 0:
            self._launch(self._launched)

    def _launch(self, b: int) -> None:
        bucket = self.buckets[b]
        bucket.div_(self.world_size)  # the mean, with a sum all-reduce (gloo has no AVG)
        self._works.append(dist.all_reduce(bucket, async_op=True))
        self._launched += 1

    def finish_backward(self) -> None:
        """Reduce buckets whose parameters got no gradient this step, then make the stream wait for all."""
        if self.world_size <= 1:
            return
        while self._launched < len(self.buckets):
            self._launch(self._launched)
        for work in self._works:
            work.wait()
        self._works = []


def _dense(t: torch.Tensor) -> bool:
    """Laid out as one contiguous block (row-major or channels_last), so a flat slice can hold its grad."""
    formats = [torch.contiguous_format]
    if t.dim() == 4:
        formats.append(torch.channels_last)
    return any(t.is_contiguous(memory_format=f) for f in formats)
