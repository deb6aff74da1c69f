"""launcher/train/misfit.py: which failures of a first step are a network that does not take its batches."""

from types import SimpleNamespace

import torch

from launcher.train.misfit import describe, does_not_take, shape_error, short_vocabulary


def test_torchs_shape_sentences_are_found_plain_wrapped_and_chained():
    conv = "Given groups=1, weight of size [64, 3, 7, 7], expected input[64, 1, 8, 8] to have 3 channels, but got 1"
    assert shape_error(RuntimeError(conv)) == conv
    wrapped = RuntimeError(f"Dynamo failed to run FX node with fake tensors: call_function <conv2d>(...): got "
                           f"RuntimeError('{conv}')\n\nfrom user code: ...")
    assert shape_error(wrapped) == conv
    try:
        try:
            torch.ones(4, 5) @ torch.ones(6, 7)
        except RuntimeError as inner:
            raise ValueError("the step failed") from inner
    except ValueError as outer:
        assert shape_error(outer).startswith("mat1 and mat2 shapes cannot be multiplied (4x5 and 6x7)")
    assert shape_error(IndexError("Target 12 is out of bounds.")) == "Target 12 is out of bounds."


def test_other_failures_are_not_a_misfit():
    assert shape_error(RuntimeError("CUDA error: an illegal memory access was encountered")) is None
    assert shape_error(NameError("name 'undefined_name' is not defined")) is None
    assert shape_error(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")) is None


def test_a_batch_is_described_by_its_tensors_shapes():
    assert describe((torch.zeros(8, 1, 8, 8, dtype=torch.uint8), torch.zeros(8, dtype=torch.int64))) == \
        "8x1x8x8 uint8, 8 int64"
    assert describe({"x": torch.zeros(2, 3), "mask": torch.ones(2, 3, dtype=torch.bool)}) == "2x3 float32, 2x3 bool"


def test_fewer_outputs_than_classes_says_which_setting_to_drop():
    batch = (torch.zeros(8, 3, 32, 32), torch.zeros(8, dtype=torch.int64))
    cfg = SimpleNamespace(model={"_target_": "torchvision.models.resnet18", "num_classes": 2},
                          recipe=SimpleNamespace(name="imagefolder", model="resnet50"))
    line = str(does_not_take(cfg, True, batch, IndexError("Target 2 is out of bounds.")))
    assert line.startswith("model._target_=torchvision.models.resnet18 is not valid: the network has fewer outputs "
                           "than recipe=imagefolder's data has classes (Target 2 is out of bounds): drop "
                           "+model.num_classes")
    assert ".;" not in line
    mine = SimpleNamespace(model={"_target_": None}, recipe=SimpleNamespace(name="my_recipe", model="net"))
    assert does_not_take(mine, False, batch, IndexError("Target 2 is out of bounds.")) is None  # (the user's own)


def test_a_config_network_with_more_outputs_than_classes_is_said():
    from torch import nn

    from launcher.train.misfit import surplus_outputs

    wide = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1000))
    said = surplus_outputs(wide, 3, "my_nets.Wide", "imagefolder")
    assert "last layer (2) gives 1000 outputs for the 3 classes of recipe=imagefolder" in said
    assert "+model.num_classes=3" in said
    assert surplus_outputs(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 3)), 3, "t", "r") is None
    assert surplus_outputs(nn.Conv2d(3, 8, 3), 3, "t", "r") is None  # (no linear layer: nothing to say)
    own = surplus_outputs(wide, 3, None, "my_recipe")  # (the recipe's own network: no model._target_)
    assert own.startswith("recipe=my_recipe's network: its last layer (2) gives 1000 outputs") and "+model" not in own


def test_the_default_hooks_name_the_hook_to_write_for_batches_that_are_not_pairs():
    import pytest
    from torch import nn

    from launcher.errors import ConfigError
    from launcher.recipes import Recipe

    class Mine(Recipe):
        def __init__(self):
            pass

    batch = {"x": torch.ones(2, 4), "y": torch.ones(2, 1)}
    with pytest.raises(ConfigError, match=r"a dict with keys x, y, and the default eval_step takes \(inputs, labels\) "
                                          r"pairs: define eval_step\(self, model, batch\) in Mine"):
        Mine().eval_step(nn.Linear(4, 2), batch)
    with pytest.raises(ConfigError, match="default training_step"):
        Mine().training_step(nn.Linear(4, 2), batch)


def test_only_a_failure_before_the_first_step_has_run_is_the_networks_one_line():
    """A shape mismatch in the first step is the network that does not take the batches (the key that chose it);
    once a step has run, the same sentence is a later batch's own failure, raised as it is."""
    import pytest

    from launcher.errors import ConfigError
    from launcher.train.misfit import FirstSteps

    cfg = SimpleNamespace(model={"_target_": "torchvision.models.resnet18"}, recipe=SimpleNamespace(name="digits"))
    batch = (torch.zeros(8, 1, 8, 8), torch.zeros(8, dtype=torch.int64))
    conv = "Given groups=1, weight of size [64, 3, 7, 7], expected input[8, 1, 8, 8] to have 3 channels, but got 1"
    first_steps = FirstSteps(cfg, builtin=True)
    with pytest.raises(ConfigError, match="^model._target_=torchvision.models.resnet18 is not valid: the network "
                                          "does not take recipe=digits's batches"):
        with first_steps(batch):
            raise RuntimeError(conv)
    with first_steps(batch):
        pass  # the first step that runs
    with pytest.raises(RuntimeError, match="^Given groups=1"):
        with first_steps(batch):
            raise RuntimeError(conv)


def test_a_built_network_embedding_fewer_tokens_than_the_data_has_is_refused_in_the_worker():
    """The worker's check of the network it built (a vocabulary set where recipe=text's check before the workers
    does not look, e.g. a user's class taking its own vocabulary argument): fewer embedding rows than the data's
    tokens is the one line; as many or more, or no input embedding to read, is no refusal."""

    class Embeds(torch.nn.Module):
        def __init__(self, rows: int):
            super().__init__()
            self.embed = torch.nn.Embedding(rows, 4)

        def get_input_embeddings(self):
            return self.embed

    refused = short_vocabulary(Embeds(100), 256, "my.Net")
    assert refused is not None and refused.exit_code == 2
    assert "model._target_=my.Net embeds 100 tokens, but the data's ids run to 255" in str(refused)
    assert short_vocabulary(Embeds(256), 256, "my.Net") is None and short_vocabulary(Embeds(300), 256, "my.Net") is None
    assert short_vocabulary(torch.nn.Linear(2, 2), 256, "my.Net") is None

