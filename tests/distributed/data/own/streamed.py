"""A recipe whose training set is an IterableDataset (a stream of sample ids, in an order drawn from the epoch
it is told) and whose evaluation figure is a 0-dim batch mean: every rank records, step by step, which ids it
trained and the epoch its reader was told (streamed-{rank}.jsonl)."""

import json
import os
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from launcher.recipes import Recipe, RecipeConfig


class Ids(IterableDataset):
    def __init__(self, n: int):
        self.n, self.epoch = n, 0

    def __len__(self):
        return self.n

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        worker = get_worker_info()
        order = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.epoch)).tolist()
        for i in order:
            yield {"x": torch.full((4,), i / self.n), "id": i, "epoch": self.epoch,
                   "worker": -1 if worker is None else worker.id}


class Squares(Dataset):
    """Evaluation sample i holds i * i: the exact mean over n samples is sum(i * i) / n."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"x": torch.zeros(4), "value": torch.tensor(float(i * i))}


@dataclass
class StreamedConfig(RecipeConfig):
    samples: int = 48
    eval_samples: int = 37


class Streamed(Recipe):
    Config = StreamedConfig
    models = ("linear",)

    def load(self):
        return Ids(self.hp.samples), Squares(self.hp.eval_samples)

    def build_model(self, num_classes):
        return nn.Linear(4, 1)

    def training_step(self, model, batch):
        rank = int(os.environ.get("RANK", "0"))
        with open(f"streamed-{rank}.jsonl", "a") as f:  # (a host read: this recipe is for CPU tests)
            f.write(json.dumps({"ids": batch["id"].tolist(), "epochs": batch["epoch"].tolist(),
                                "workers": batch["worker"].tolist()}) + "\n")
        return model(batch["x"]).pow(2).mean()

    def eval_step(self, model, batch):  # a 0-dim batch mean: the launcher weighs it by the batch's samples
        return {"value": batch["value"].mean()}
