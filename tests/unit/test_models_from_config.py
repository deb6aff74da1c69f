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
