"""launcher/models.py: a `model._target_` that cannot be used is one line, with a hint that fits the mistake."""

import pytest

from launcher.errors import ConfigError
from launcher.models import locate


def refusal(target: str) -> str:
    with pytest.raises(ConfigError) as caught:
        locate({"_target_": target})
    return str(caught.value)


def test_a_name_the_package_does_not_hold_gets_its_close_names_not_an_install_hint():
    said = refusal("collections.OrderedDic")
    assert "did you mean collections.OrderedDict?" in said and "installed?" not in said
    said = refusal("collections.zzzzzz")
    assert "collections is installed, but holds no zzzzzz" in said


def test_a_misspelt_package_gets_the_installed_one_and_an_absent_one_an_install_hint():
    assert "did you mean collections.OrderedDict?" in refusal("colections.OrderedDict")
    assert "is qqqqzzzz installed?" in refusal("qqqqzzzz.Net")


def test_a_callable_is_found():
    from collections import OrderedDict

    assert locate({"_target_": "collections.OrderedDict"}) is OrderedDict


def test_the_recipes_class_count_is_passed_where_the_network_takes_it_and_the_config_gives_none(tmp_path,
                                                                                              monkeypatch):
    from launcher.models import from_config

    (tmp_path / "my_nets.py").write_text(
        "import torch\n\n"
        "def net(num_classes=1000, width=4):\n    return torch.nn.Linear(width, num_classes)\n\n"
        "def any_args(**kwargs):\n    return torch.nn.Linear(4, kwargs.get('num_classes', 1000))\n\n"
        "def fixed(width=4):\n    return torch.nn.Linear(width, 2)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert from_config({"_target_": "my_nets.net"}, num_classes=10).out_features == 10
    assert from_config({"_target_": "my_nets.net", "num_classes": 3}, num_classes=10).out_features == 3  # typed
    assert from_config({"_target_": "my_nets.any_args"}, num_classes=10).out_features == 10
    assert from_config({"_target_": "my_nets.fixed"}, num_classes=10).out_features == 2
