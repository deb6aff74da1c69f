"""digits: the UCI handwritten digits (1,797 real 8x8 images, CC BY 4.0), shipped inside the package.

The recipe that runs anywhere, offline, on CPU or GPU, in seconds: `launch` with no arguments.
Data: E. Alpaydin and C. Kaynak (1998), UCI Machine Learning Repository; see data/README.md.
Hyper-parameters: DigitsConfig in launcher/config.py; values: conf/recipe/digits.yaml.
"""

from __future__ import annotations

from importlib import resources

import numpy as np
import torch
from torch import nn

from launcher.config import DigitsConfig
from launcher.data.augment import image_augmentation
from launcher.recipes import Augment, Recipe, Splits

TEST_FRACTION = 0.2
SPLIT_SEED = 1998  # fixed, so the test set is the same for every run whatever `seed` is


def _conv_bn(c_in: int, c_out: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU(inplace=True))


class Digits(Recipe):
    Config = DigitsConfig
    hp: DigitsConfig

    def load(self) -> Splits:
        with resources.files("launcher.recipes").joinpath("data/digits.npz").open("rb") as f:
            data = np.load(f)
            images, labels = data["images"], data["labels"]
        # A stratified split: the same share of every class in the test set.
        rng = np.random.default_rng(SPLIT_SEED)
        test_idx = []
        for c in range(10):
            members = np.flatnonzero(labels == c)
            rng.shuffle(members)
            test_idx.extend(members[: round(len(members) * TEST_FRACTION)])
        test_mask = np.zeros(len(labels), dtype=bool)
        test_mask[test_idx] = True
        x = torch.from_numpy(images).unsqueeze(1)  # (N, 1, 8, 8) uint8 in 0..16
        y = torch.from_numpy(labels.astype(np.int64))
        train_x, train_y = x[~test_mask], y[~test_mask]
        mean = train_x.float().mean().item()
        std = train_x.float().std().item()
        return Splits(train_x, train_y, x[test_mask], y[test_mask], 10, (mean,), (std,))

    def augmentation(self) -> Augment | None:
        # Shifts only: conf/recipe/digits.yaml sets recipe.flip=none (digits are not mirror-symmetric).
        return image_augmentation(self.hp, self.cfg.seed) if self.hp.augment else None

    def loss(self) -> nn.Module:
        return nn.CrossEntropyLoss(label_smoothing=self.hp.label_smoothing)

    def build_model(self, num_classes: int) -> nn.Module:
        w = self.hp.width
        return nn.Sequential(
            _conv_bn(1, w), _conv_bn(w, 2 * w), nn.MaxPool2d(2),  # 8x8 -> 4x4
            _conv_bn(2 * w, 4 * w), nn.MaxPool2d(2),  # -> 2x2
            nn.Flatten(), nn.Dropout(0.1), nn.Linear(4 * w * 4, num_classes),
        )
