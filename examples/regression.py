"""A regression on your own Dataset, RMSE as its figure: `launch recipe=regression` (this file, in the
directory launch runs in), and `launch -m recipe=regression recipe.hidden=32,128 sweep.objective=test_rmse`."""

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.data import TensorDataset, random_split

from launcher.recipes import Recipe, RecipeConfig


@dataclass
class RegressionConfig(RecipeConfig):
    hidden: int = 64  # recipe.hidden=128
    samples: int = 4096


class Regression(Recipe):
    Config = RegressionConfig
    models = ("mlp",)
    figures = ("loss", "test_mse", "test_rmse")  # its epochs' figures: a misnamed early_stop.metric is refused at once

    def load(self):  # any two Datasets: (train, eval)
        g = torch.Generator().manual_seed(0)
        x = torch.randn(self.hp.samples, 8, generator=g)
        y = torch.sin(2 * x[:, :1]) + x[:, 1:2] * x[:, 2:3] + 0.05 * torch.randn(self.hp.samples, 1, generator=g)
        return random_split(TensorDataset(x, y), [0.8, 0.2], generator=g)

    def build_model(self, num_classes):
        return nn.Sequential(nn.Linear(8, self.hp.hidden), nn.GELU(), nn.Linear(self.hp.hidden, 1))

    def training_step(self, model, batch):  # the loss (and, optionally, named figures)
        x, y = batch
        return nn.functional.mse_loss(model(x).float(), y)

    def eval_step(self, model, batch):  # named figures, averaged over the whole evaluation set
        x, y = batch
        return {"mse": ((model(x).float() - y) ** 2).mean(1)}

    def report(self, row, device, world_size):  # figures derived from the exact means
        if "test_mse" in row:
            row["test_rmse"] = math.sqrt(row["test_mse"])
