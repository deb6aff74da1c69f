"""Batched image augmentation that runs where the batch already is (GPU or CPU), without a DataLoader.

Training augmentations take a batch (N, C, H, W) and a torch.Generator (or the rows' indices) on the
batch's device, so a run is reproducible from its seed and the CPU never touches pixels during
training. `tta_logits` is the evaluation-time counterpart.
"""

from __future__ import annotations

import torch


def _shifted(x: torch.Tensor, max_shift: int, dy: torch.Tensor, dx: torch.Tensor) -> torch.Tensor:
    """Each image cropped at (dy, dx) out of its reflection padding of `max_shift` pixels: a random
    shift of up to `max_shift` pixels each way, done as one gather."""
    n, _, h, w = x.shape
    padded = torch.nn.functional.pad(x.float() if not x.is_floating_point() else x, (max_shift,) * 4, mode="reflect")
    padded = padded.to(x.dtype)
    rows = (dy.view(n, 1) + torch.arange(h, device=x.device)).view(n, 1, h, 1)
    cols = (dx.view(n, 1) + torch.arange(w, device=x.device)).view(n, 1, 1, w)
    batch = torch.arange(n, device=x.device).view(n, 1, 1, 1)
    channel = torch.arange(x.shape[1], device=x.device).view(1, -1, 1, 1)
    return padded[batch, channel, rows, cols]


def alternating_flip(x: torch.Tensor, indices: torch.Tensor, epoch: int, seed: int) -> torch.Tensor:
    """Mirror a fixed half of the images on even epochs and the other half on odd ones.

    Which half an image is in comes from a hash of its index in the training set and the seed, so it is
    the same on every rank and after a resume. Every image is then seen both ways in every two epochs,
    which random flipping only gives on average (Jordan 2024, "94% on CIFAR-10 in 3.29 seconds").
    """
    mixed = (indices.long() * 2_654_435_761 + seed * 40_503 + 12_345) % (1 << 32)
    flip = ((mixed >> 16) & 1) ^ (epoch % 2)
    return torch.where(flip.bool().view(-1, 1, 1, 1), x.flip(3), x)


class ImageAugmentation:
    """The image recipes' training augmentation (`recipe.flip`, `recipe.translate`), called as
    `augment(x, generator, *, indices, epoch)`, in two parts: `draw` takes the step's random numbers
    from the run's generator (a flip per image, then the shifts: the order of earlier versions, so runs
    give the same images as before) and `apply` moves the pixels as a pure function of them, which
    torch.compile can fuse with the normalization (dynamo does not take generators):
    launcher/train/step.py does that for compiled, captured steps."""

    def __init__(self, flip: str, translate: int, seed: int):
        self.flip, self.translate, self.seed = flip, translate, seed

    def draw(self, x: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor | None, ...]:
        n = x.shape[0]
        flips = torch.rand(n, device=x.device, generator=generator) < 0.5 if self.flip == "random" else None
        if self.translate <= 0:
            return flips, None, None
        span = 2 * self.translate + 1
        dy = torch.randint(0, span, (n,), device=x.device, generator=generator)
        dx = torch.randint(0, span, (n,), device=x.device, generator=generator)
        return flips, dy, dx

    def apply(self, x: torch.Tensor, draws: tuple[torch.Tensor | None, ...], indices: torch.Tensor,
              epoch: int | torch.Tensor) -> torch.Tensor:
        flips, dy, dx = draws
        if flips is not None:
            x = torch.where(flips.view(-1, 1, 1, 1), x.flip(3), x)
        elif self.flip == "alternating":
            x = alternating_flip(x, indices, epoch, self.seed)
        if dy is None:
            return x
        return _shifted(x, self.translate, dy, dx)

    def __call__(self, x: torch.Tensor, generator: torch.Generator, *, indices: torch.Tensor,
                 epoch: int | torch.Tensor) -> torch.Tensor:
        return self.apply(x, self.draw(x, generator), indices, epoch)


def image_augmentation(hp, seed: int) -> ImageAugmentation:
    """The image recipes' augmentation as a function of (x, generator, *, indices, epoch).

    `hp` is an ImageRecipeConfig (`recipe.flip`, `recipe.translate`), read here once.
    """
    return ImageAugmentation(str(hp.flip), hp.translate, seed)


def tta_views(x: torch.Tensor, level: int) -> tuple[torch.Tensor, list[float]]:
    """Test-time augmentation as one batch: the views of `x` stacked, and each view's weight.

    level 0: x. level 1: x and its mirror. level 2: those, plus both mirrored and unmirrored copies
    shifted one pixel up-left and down-right (weights 1/4 for the originals, 1/8 for each shift).
    Stacking lets the network score all views in one forward pass (BatchNorm is per-sample in eval).
    """
    if level == 0:
        return x, [1.0]
    views = [x, x.flip(3)]
    weights = [0.5, 0.5]
    if level >= 2:
        h, w = x.shape[2:]
        padded = torch.nn.functional.pad(x, (1, 1, 1, 1), mode="reflect")
        for shifted in (padded[:, :, :h, :w], padded[:, :, 2:, 2:]):
            views += [shifted, shifted.flip(3)]
        weights = [0.25, 0.25, 0.125, 0.125, 0.125, 0.125]
    stacked = torch.cat(views)
    if x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous():
        stacked = stacked.contiguous(memory_format=torch.channels_last)
    return stacked, weights


def tta_logits(net: torch.nn.Module, x: torch.Tensor, level: int) -> torch.Tensor:
    """The weighted mean of the network's logits over the TTA views of `x`."""
    views, weights = tta_views(x, level)
    logits = net(views).float().view(len(weights), len(x), -1)
    if level == 0:
        return logits[0]
    # (the weights as Python numbers: a tensor made from them would be a copy to the GPU that waits for
    # the device, in an evaluation queued behind the epoch's steps)
    return sum(w * view for w, view in zip(weights, logits.unbind(0), strict=True))
