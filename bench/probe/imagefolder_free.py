"""Probe (issue 33): recipe=imagefolder with its decoding taken away, as a recipe file.

    cd bench/probe && launch recipe=imagefolder_free data.root=/tmp/imagenet-gen gpus=[0] perf.compile=true \\
        eval.every=0 epochs=5 $(cat imagefolder_free.args)

A recipe file gets the launcher's defaults, not conf/recipe/imagefolder.yaml's: imagefolder_free.args holds
that file's settings (batch 256, channels_last, no CUDA graph, its lr, weight decay, warm-up, smoothing).

The same folder's classes and sizes, the same launcher path (DataLoader workers, collate, pinned copy on the
side stream, normalisation, the compiled step), but each sample is one fixed 224 x 224 crop already decoded:
the workers do next to nothing. Its img/s is launch's own limit on this data path: the gap between it and
the bench's limit (a batch already on the GPU) is the launcher's step and pipeline; the gap between it and
data.decode=cpu is the decoding.
"""

from __future__ import annotations

from typing import Any

import torch

from launcher.recipes.imagefolder import ImageFolder


class Decoded(torch.utils.data.Dataset):
    """The split's labels, every image the same uint8 CHW crop."""

    def __init__(self, split: Any, size: int):
        self.labels = split.targets
        self.classes = split.classes
        self.image = torch.randint(0, 256, (3, size, size), dtype=torch.uint8,
                                   generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.image, self.labels[index]


class ImageFolderFree(ImageFolder):
    def load(self):
        train, val = super().load()
        self.trial = None  # (no decoding to try)
        return Decoded(train, self.hp.image_size), Decoded(val, self.hp.image_size)
