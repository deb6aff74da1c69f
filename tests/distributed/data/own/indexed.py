"""A Dataset recipe that records, on every rank, which samples each step trained on (indices.jsonl): the test
of the order a resume continues. Dict samples with a mask, to show batches of any structure."""

import json
import os
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.data import Dataset

from launcher.recipes import Recipe, RecipeConfig


class Numbers(Dataset):
    def __init__(self, n: int, offset: int = 0):
        self.n, self.offset = n, offset

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        x = torch.full((4,), float(i + self.offset) / self.n)
        return {"x": x, "target": {"y": x.sum(0, keepdim=True)}, "mask": torch.ones(4, dtype=torch.bool), "index": i}


@dataclass
class IndexedConfig(RecipeConfig):
    samples: int = 96


class Indexed(Recipe):
    Config = IndexedConfig
    models = ("linear",)

    def load(self):
        return Numbers(self.hp.samples), Numbers(37, offset=1000)

    def build_model(self, num_classes):
        return nn.Linear(4, 1)

    def training_step(self, model, batch):
        rank = int(os.environ.get("RANK", "0"))
        with open(f"indices-{rank}.jsonl", "a") as f:  # (a host read: this recipe is for CPU tests)
            f.write(json.dumps(batch["index"].tolist()) + "\n")
        pred = model(batch["x"] * batch["mask"])
        return nn.functional.mse_loss(pred, batch["target"]["y"]), {"abs_err": (pred - batch["target"]["y"]).abs()}

    def eval_step(self, model, batch):
        return {"mse": ((model(batch["x"]) - batch["target"]["y"]) ** 2).squeeze(1), "count": torch.ones(())}
