"""The composed config: groups, recipe defaults, typed schema (typos fail at compose time), range checks."""

import pytest
from hydra import compose, initialize_config_module
from hydra.errors import ConfigCompositionException

from launcher.config import ConfigError, register, validate


def composed(*overrides: str):
    register()
    with initialize_config_module(config_module="launcher.conf", version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def test_default_is_digits_on_auto():
    cfg = composed()
    assert cfg.recipe.name == "digits" and cfg.strategy.name == "auto" and cfg.backend.name == "local"
    assert cfg.gpus == "auto" and cfg.nprocs is None and cfg.resume is None and cfg.max_restarts == 0
    validate(cfg)


def test_recipe_sets_its_own_top_level_defaults_and_overrides_win():
    cifar = composed("recipe=cifar10")
    assert (cifar.recipe.model, cifar.batch_size, cifar.epochs) == ("airbench", 1024, 10)
    assert composed("recipe=cifar10", "batch_size=256").batch_size == 256
    assert composed("recipe=cifar10", "recipe.model=resnet18").recipe.model == "resnet18"


def test_strategy_group_and_options():
    cfg = composed("strategy=ddp", "strategy.static_graph=true")
    assert cfg.strategy.name == "ddp" and cfg.strategy.static_graph is True


def test_gpus_takes_lists_counts_and_words():
    assert list(composed("gpus=[0,1]").gpus) == [0, 1]
    assert composed("gpus=2").gpus == 2
    assert composed("gpus=all").gpus == "all"
    assert list(composed("gpus=[]").gpus) == []


@pytest.mark.parametrize("override", ["epoch=3", "recipe.modle=x", "strategy.bucket=1", "data.synth=true"])
def test_typo_fails_at_compose_time(override):
    with pytest.raises(ConfigCompositionException):
        composed(override)


@pytest.mark.parametrize("override", ["epochs=abc", "batch_size=1.5", "lr=fast", "dry_run=maybe"])
def test_wrong_type_fails_at_compose_time(override):
    with pytest.raises(ConfigCompositionException, match="Error merging override"):
        composed(override)


@pytest.mark.parametrize("override, key", [
    ("epochs=0", "epochs"), ("batch_size=0", "batch_size"), ("lr=0", "lr"), ("lr=inf", "lr"), ("seed=-1", "seed"),
    ("nprocs=0", "nprocs"), ("max_restarts=-1", "max_restarts"), ("strategy.timeout_s=0", "strategy.timeout_s"),
    ("recipe.momentum=1.5", "recipe.momentum"), ("recipe.precision=fp8", "recipe.precision"),
    ("recipe.optimizer=lbfgs", "recipe.optimizer"), ("fault.kind=explode", "fault.kind"), ("resume=true", "resume"),
])
def test_ranges_are_checked_with_one_line(override, key):
    with pytest.raises(ConfigError) as err:
        validate(composed(override))
    assert str(err.value).startswith(f"{key}=") and "\n" not in str(err.value)
