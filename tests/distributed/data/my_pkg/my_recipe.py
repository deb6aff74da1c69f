"""A user's own recipe, outside the launcher: the small interface of recipes/__init__.py."""

import torch
from torch import nn

from launcher.recipes import Splits

MODELS = ("mlp",)

def load(cfg):
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 255, (512, 1, 4, 4), dtype=torch.uint8, generator=g)
    y = (x.float().mean(dim=(1, 2, 3)) > 127).long()
    return Splits(x[:400], y[:400], x[400:], y[400:], 2, (127.0,), (70.0,))

def build_model(cfg, num_classes):
    return nn.Sequential(nn.Flatten(), nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, num_classes))
