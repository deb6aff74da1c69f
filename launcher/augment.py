"""Batched image augmentation that runs where the batch already is (GPU or CPU), without a DataLoader.

Both functions take a batch (N, C, H, W) and a torch.Generator on the batch's device, so a run is
reproducible from its seed and the CPU never touches pixels during training.
"""

from __future__ import annotations

import torch


def random_flip(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Mirror each image left-right with probability 1/2."""
    flip = torch.rand(x.shape[0], device=x.device, generator=generator) < 0.5
    return torch.where(flip.view(-1, 1, 1, 1), x.flip(3), x)


def random_translate(x: torch.Tensor, max_shift: int, generator: torch.Generator) -> torch.Tensor:
    """Shift each image by up to `max_shift` pixels in each direction, filling with reflected pixels.

    Equivalent to a random crop of size HxW from the reflection-padded image, done as one gather.
    """
    if max_shift <= 0:
        return x
    n, _, h, w = x.shape
    padded = torch.nn.functional.pad(x.float() if not x.is_floating_point() else x, (max_shift,) * 4, mode="reflect")
    padded = padded.to(x.dtype)
    span = 2 * max_shift + 1
    dy = torch.randint(0, span, (n,), device=x.device, generator=generator)
    dx = torch.randint(0, span, (n,), device=x.device, generator=generator)
    rows = (dy.view(n, 1) + torch.arange(h, device=x.device)).view(n, 1, h, 1)
    cols = (dx.view(n, 1) + torch.arange(w, device=x.device)).view(n, 1, 1, w)
    batch = torch.arange(n, device=x.device).view(n, 1, 1, 1)
    channel = torch.arange(x.shape[1], device=x.device).view(1, -1, 1, 1)
    return padded[batch, channel, rows, cols]
