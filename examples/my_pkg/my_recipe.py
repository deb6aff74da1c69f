"""A user's own recipe, outside the launcher: a Recipe class with its own typed hyper-parameters."""

from dataclasses import dataclass

import torch
from torch import nn

from launcher.recipes import Recipe, RecipeConfig, Splits


@dataclass
class MyConfig(RecipeConfig):
    hidden: int = 32  # launch recipe=my_pkg.my_recipe recipe.hidden=64


class MyRecipe(Recipe):
    Config = MyConfig
    models = ("mlp",)

    def load(self) -> Splits:
        g = torch.Generator().manual_seed(0)
        x = torch.randint(0, 255, (512, 1, 4, 4), dtype=torch.uint8, generator=g)
        y = (x.float().mean(dim=(1, 2, 3)) > 127).long()
        return Splits(x[:400], y[:400], x[400:], y[400:], 2, (127.0,), (70.0,))

    def build_model(self, num_classes: int) -> nn.Module:
        hidden = self.hp.hidden  # typed: an int, from recipe.hidden
        return nn.Sequential(nn.Flatten(), nn.Linear(16, hidden), nn.ReLU(), nn.Linear(hidden, num_classes))
