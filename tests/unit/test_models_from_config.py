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
    # a model library known by name, not installed: how to install it, not a near name ("timeit.create_model?")
    import importlib.util

    if importlib.util.find_spec("timm") is None:
        said = refusal("timm.create_model")
        assert "timm is not installed here: pip install timm" in said and "timeit" not in said, said


def test_a_callable_is_found():
    from collections import OrderedDict

    assert locate({"_target_": "collections.OrderedDict"}) is OrderedDict


def _lazy_net():
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.BatchNorm1d(12), nn.LazyLinear(8), nn.LazyBatchNorm1d(), nn.ReLU(),
                         nn.Dropout(0.5), nn.LazyLinear(3))


def test_lazy_layers_take_their_shapes_from_a_first_batch_alike_on_every_rank():
    """Two ranks build the same seeded model and materialize it from different batches of one shape: the same
    weights; the running statistics and the random state as before the forward (no trace of the batch)."""
    import torch

    from launcher.models import lazy_modules, materialize_lazy

    nets = []
    for rank in range(2):
        net = _lazy_net()
        batch = torch.randn(5, 3, 4, generator=torch.Generator().manual_seed(rank)) * 3 + rank
        rng = torch.get_rng_state()
        assert materialize_lazy(net, lambda n=net, b=batch: n(b).sum(), torch.device("cpu")) == []
        assert torch.equal(torch.get_rng_state(), rng)
        nets.append(net)
    assert not lazy_modules(nets[0]) and tuple(nets[0][2].weight.shape) == (8, 12)
    a, b = (dict(n.state_dict()) for n in nets)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert torch.equal(a["1.running_mean"], torch.zeros(12)) and torch.equal(a["3.running_var"], torch.ones(8))
    assert int(a["1.num_batches_tracked"]) == 0 and int(a["3.num_batches_tracked"]) == 0
    assert not any(p.grad is not None for p in nets[0].parameters())


def test_a_lazy_layer_the_first_batch_does_not_reach_is_named():
    import torch
    from torch import nn

    from launcher.models import materialize_lazy

    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.used, self.aside = nn.LazyLinear(2), nn.LazyLinear(2)

        def forward(self, x):
            return self.used(x)

    net = Branchy()
    assert materialize_lazy(net, lambda: net(torch.ones(2, 3)), torch.device("cpu")) == ["aside"]


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


def test_a_hugging_face_config_is_built_in_the_launcher_its_refusal_and_unknown_keys_one_line_each():
    """transformers kept `hiden_size=64` as an unused attribute and built the default width (4096) without a
    word; a width the heads do not divide failed in the worker with only "Class validation error for
    validator 'validate_architecture':" and a torchvision example."""
    pytest.importorskip("transformers")
    from launcher.models import check

    def spec(**config):
        return {"_target_": "transformers.LlamaForCausalLM",
                "config": {"_target_": "transformers.LlamaConfig", "num_hidden_layers": 2, **config}}

    with pytest.raises(ConfigError, match=r"^model\.config\.hiden_size=64 is not valid: LlamaConfig has no setting "
                                          r"hiden_size .*\(e\.g\. launch \+model\.config\.hidden_size=64\)$"):
        check(spec(hiden_size=64, num_attention_heads=4))
    with pytest.raises(ConfigError, match=r"failed: .*ValueError: The hidden size \(64\) is not a multiple of the "
                                          r"number of attention heads \(3\)\.$") as refused:
        check(spec(hidden_size=64, num_attention_heads=3))
    assert "torchvision" not in str(refused.value)
    check(spec(hidden_size=64, num_attention_heads=4, rope_theta=10000.0))  # (a key the class converts: kept)


def test_a_hugging_face_config_class_that_needs_arguments_is_not_refused(monkeypatch):
    """The unknown-key check builds the class's default to learn its keys; a class that cannot be built
    without arguments refused a valid run ("building it ... failed") before it was mended."""
    transformers = pytest.importorskip("transformers")
    from launcher.models import check

    class NeedsArgsConfig(transformers.PretrainedConfig):
        def __init__(self, width, **kwargs):
            self.width = width
            super().__init__(**kwargs)

    from transformers.models.llama import configuration_llama

    monkeypatch.setattr(configuration_llama, "NeedsArgsConfig", NeedsArgsConfig, raising=False)
    check({"_target_": "transformers.LlamaForCausalLM",
           "config": {"_target_": "transformers.models.llama.configuration_llama.NeedsArgsConfig", "width": 64}})
