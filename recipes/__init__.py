"""Training recipes. A recipe is a module with this small interface:

    prepare(cfg) -> None            once, in the launcher process, before any worker starts: fetch or
                                    check data. Must not touch CUDA (the launcher has not set the mask).
    MODELS                          optional: the names `recipe.model` may take (checked up front).
    load(cfg) -> Splits             in every worker: the whole dataset as uint8/int64 CPU tensors.
    build_model(cfg, num_classes)   the nn.Module; `cfg.recipe.model` picks among the recipe's models.
    augmentation(cfg) -> augment    optional, called once: returns augment(x, generator, *, indices,
                                    epoch) -> x, batched augmentation on the batch's own device;
                                    `indices` are the batch's rows in the training set (same device).
                                    launcher.augment.image_augmentation is the image recipes' one.
    prepare_model(cfg, model, sample)
                                    optional: set up the model from data before training (e.g. a
                                    whitening layer); `sample` is up to 5,000 normalized training images.
    predict(cfg, net, x) -> logits  optional: evaluation forward pass (e.g. test-time augmentation).

A model trained with `recipe.optimizer=muon` says which of its parameters are which through
`parameter_roles()` (see launcher/optim.py).

The shared training loop (launcher/loop.py) does the rest: strategy, data placement, batching, metrics,
checkpoints.
"""

from __future__ import annotations

import importlib
import os
import sys
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING

from launcher.config import ConfigError

if TYPE_CHECKING:
    import torch

BUILTIN = ("digits", "cifar10")


@dataclass
class Splits:
    """A dataset held in memory: images (N, C, H, W) uint8 and labels (N,) int64, with per-channel stats."""

    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    num_classes: int
    mean: tuple[float, ...]  # per channel, in the stored pixel units
    std: tuple[float, ...]
    synthetic: bool = False


def _allow_imports_from_cwd() -> None:
    """`recipe=my_pkg.my_recipe` finds a package in the directory `launch` runs in, as `python -m` would."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)


def get_recipe(name: str) -> ModuleType:
    """The recipe module for `recipe.name`: a built-in name, or a dotted path to a user's module."""
    module_name = f"launcher.recipes.{name}" if name in BUILTIN else name
    if name not in BUILTIN:
        _allow_imports_from_cwd()
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and module_name.startswith(exc.name):
            raise ConfigError("recipe", name, "choose one of " + ", ".join(BUILTIN) +
                              " or a module path on PYTHONPATH", "recipe=digits") from None
        raise
    missing = [f for f in ("load", "build_model") if not callable(getattr(module, f, None))]
    if missing:
        raise ConfigError("recipe", name, f"module {module_name} lacks {', '.join(missing)}() "
                          "(see launcher/recipes/__init__.py for the interface)", "recipe=digits")
    return module


def check_model(module: ModuleType, cfg) -> None:
    """A recipe that lists its models in MODELS gets `recipe.model` checked before any worker starts."""
    models = getattr(module, "MODELS", None)
    if models is not None and cfg.recipe.model not in models:
        first = next(iter(models))
        raise ConfigError("recipe.model", cfg.recipe.model, f"{cfg.recipe.name} has: {', '.join(models)}",
                          f"recipe={cfg.recipe.name} recipe.model={first}")


def prepare(module: ModuleType, cfg) -> None:
    fn = getattr(module, "prepare", None)
    if fn is not None:
        fn(cfg)
