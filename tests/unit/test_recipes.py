"""The Recipe interface (recipes/__init__.py: a user's recipe module found, its model checked before any
worker) and the built-in recipes' data and networks without a launch: digits' split, the CIFAR ResNet-18."""

from __future__ import annotations

from importlib import resources
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from launcher.errors import ConfigError, LaunchError
from launcher.recipes import Recipe, check_model, recipe_class
from tests.conftest import config_of

TWO_RECIPES = """
from launcher.recipes import Recipe

class First(Recipe):
    pass

class Second(Recipe):
    pass
"""


def test_a_module_with_two_recipe_classes_is_one_line_naming_them(tmp_path, monkeypatch):
    """Which of two classes would train is a guess: refused, each named, before any worker."""
    (tmp_path / "two_recipes_here.py").write_text(TWO_RECIPES)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(LaunchError, match=r"recipe=two_recipes_here is not valid: two_recipes_here defines 2 Recipe "
                                          r"classes \(First, Second\); keep one per module"):
        recipe_class("two_recipes_here")


class _Listed(Recipe):
    models = ("mlp", "cnn")


def test_a_recipe_that_lists_its_models_refuses_another_name_before_any_worker():
    cfg = SimpleNamespace(recipe=SimpleNamespace(name="my_pkg.mine", model="resnet"), optim=SimpleNamespace(name="sgd"))
    with pytest.raises(ConfigError, match=r"recipe.model=resnet is not valid: my_pkg.mine has: mlp, cnn .*"
                                          r"recipe=my_pkg.mine recipe.model=mlp"):
        check_model(_Listed, cfg)
    check_model(_Listed, SimpleNamespace(recipe=SimpleNamespace(name="my_pkg.mine", model="cnn"),
                                         optim=SimpleNamespace(name="sgd")))


def test_optim_muon_with_a_model_that_names_no_matrices_is_refused_before_any_worker():
    from launcher.recipes.cifar10 import Cifar10

    with pytest.raises(ConfigError, match=r"resnet18 does not say"):
        check_model(Cifar10, config_of("recipe=cifar10", "recipe.model=resnet18", "optim=muon"))
    check_model(Cifar10, config_of("recipe=cifar10_fast"))  # (airbench94 names them)


def test_digits_holds_out_a_fifth_of_every_class_and_trains_on_the_rest_only():
    from launcher.recipes.digits import Digits

    splits = Digits(config_of()).load()
    with resources.files("launcher.recipes").joinpath("data/digits.npz").open("rb") as f:
        everything = np.load(f)["labels"]
    assert len(splits.train_y) + len(splits.test_y) == len(everything) == 1797
    for c in range(10):
        members = int((everything == c).sum())
        assert int((splits.test_y == c).sum()) == round(members * 0.2), c
        assert int((splits.train_y == c).sum()) == members - round(members * 0.2), c
    # no test image among the training images (a few digits are drawn alike: compare with their labels)
    train = {(bytes(x.numpy()), int(y)) for x, y in zip(splits.train_x, splits.train_y, strict=True)}
    shared = sum((bytes(x.numpy()), int(y)) in train for x, y in zip(splits.test_x, splits.test_y, strict=True))
    assert shared <= 2, shared
    assert splits.mean == pytest.approx((splits.train_x.float().mean().item(),))


def test_digits_trains_with_the_label_smoothing_asked_for():
    from launcher.recipes.digits import Digits

    assert Digits(config_of("recipe.label_smoothing=0.1")).loss().label_smoothing == pytest.approx(0.1)
    assert Digits(config_of()).loss().label_smoothing == 0.0


def test_digits_network_has_the_width_asked_for_and_a_resumed_old_run_can_ask_for_its_own():
    """recipe.width: the convolutions' channels (w, 2w, 4w); 16 by default. Runs from before had 32: a checkpoint
    of theirs loads into the network recipe.width=32 builds."""
    from launcher.recipes.digits import Digits

    def channels(net):
        return [m.out_channels for m in net.modules() if isinstance(m, torch.nn.Conv2d)]

    assert channels(Digits(config_of()).build_model(10)) == [16, 32, 64]
    wide = Digits(config_of("recipe.width=32")).build_model(10)
    assert channels(wide) == [32, 64, 128]
    def block(c_in, c_out):
        nn = torch.nn
        return nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU())

    old = torch.nn.Sequential(  # the network of runs before recipe.width existed
        block(1, 32), block(32, 64), torch.nn.MaxPool2d(2), block(64, 128), torch.nn.MaxPool2d(2),
        torch.nn.Flatten(), torch.nn.Dropout(0.1), torch.nn.Linear(512, 10))
    wide.load_state_dict(old.state_dict())  # (strict: every name and shape the same)
    with pytest.raises(ConfigError, match="recipe.width=0 is not valid: must be an integer from 1 to 1024"):
        config_of("recipe.width=0")


def test_resnet18_is_the_cifar_variant_down_to_4x4_before_its_pool():
    """He et al.'s CIFAR ResNet-18: a 3x3 stem, no max-pool, three stages halving 32x32 to 4x4; 11.2M parameters."""
    from launcher.recipes.vision_models import ResNet18

    model = ResNet18(10)
    seen = []
    model.layers.register_forward_hook(lambda module, args, out: seen.append(tuple(out.shape)))
    assert model(torch.zeros(2, 3, 32, 32)).shape == (2, 10)
    assert seen == [(2, 512, 4, 4)]
    assert sum(p.numel() for p in model.parameters()) == 11_173_962
