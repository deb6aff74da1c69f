"""recipe=imagefolder, recording on every rank which samples each step trained on (indices-<rank>.jsonl): the
test of the order a resume continues, on the image folder's own data path (its workers, its collate, its
decoding on the GPU where there is one). A user's recipe in a plain file that extends a built-in one."""

import json
import os

import torch

from launcher.data.images import collate
from launcher.recipes.imagefolder import ImageFolder


class WithIndex(torch.utils.data.Dataset):
    """The split's samples as (sample, index); None where the split skipped a bad file."""

    def __init__(self, split):
        self.split = split

    def __len__(self):
        return len(self.split)

    def __getattr__(self, name):  # classes, targets, set_epoch: the split's
        if name == "split":
            raise AttributeError(name)
        return getattr(self.split, name)

    def __getitem__(self, i):
        sample = self.split[i]
        return None if sample is None else (sample, i)


class IndexedImages(ImageFolder):
    def load(self):
        train, val = super().load()
        return WithIndex(train), WithIndex(val)

    def collate(self, samples):
        return collate([s for s, _ in samples]), torch.tensor([i for _, i in samples])

    def on_after_batch_transfer(self, batch, training):
        inner, index = batch
        return super().on_after_batch_transfer(inner, training), index

    def training_step(self, model, batch):
        images, index = batch
        rank = int(os.environ.get("RANK", "0"))
        with open(f"indices-{rank}.jsonl", "a") as f:  # (a host read each step: for tests)
            f.write(json.dumps(index.tolist()) + "\n")
        return super().training_step(model, images)

    def eval_step(self, model, batch):
        return super().eval_step(model, batch[0])
