"""The composed config: groups with a schema per option, recipe values, typos and wrong types failing at
compose time, range checks, and the typed, frozen config that workers get."""

import dataclasses
import pickle

import pytest
from hydra.errors import ConfigCompositionException

from launcher import config as schema
from launcher.errors import ConfigError
from launcher.host.compose import typed
from tests.conftest import composed, config_of


def test_default_is_digits_on_auto():
    cfg = config_of()
    assert cfg.recipe.name == "digits" and cfg.strategy.name == "auto" and cfg.backend.name == "local"
    assert cfg.gpus == "auto" and cfg.nprocs is None and cfg.resume is None and cfg.max_restarts == 0
    assert isinstance(cfg.recipe, schema.DigitsConfig) and isinstance(cfg.optim, schema.SGDConfig)


def test_recipe_sets_its_own_values_across_sections_and_overrides_win():
    cifar = config_of("recipe=cifar10")
    assert (cifar.recipe.model, cifar.batch_size, cifar.epochs) == (schema.Cifar10Model.airbench, 1024, 10)
    assert cifar.optim.warmup_epochs == 2 and cifar.perf.cuda_graph and cifar.eval.batch_size == 2048
    assert config_of("recipe=cifar10", "batch_size=256").batch_size == 256
    assert config_of("recipe=cifar10", "recipe.model=resnet18").recipe.model is schema.Cifar10Model.resnet18
    assert config_of("recipe=cifar10", "optim.warmup_epochs=5").optim.warmup_epochs == 5


def test_text_evaluates_in_chunks_of_its_training_batch_unless_told():
    """Evaluation holds one layer's activations of its chunk, training every layer's of its batch; a text
    chunk of 256 windows beside a training batch of 8 was the peak of a 2-GPU run (fsdp and ddp alike),
    so a batch lowered to fit memory did not lower the peak."""
    assert config_of("recipe=text").eval.batch_size == config_of("recipe=text").batch_size == 64
    assert config_of("recipe=text", "batch_size=8").eval.batch_size == 8
    assert config_of("recipe=text", "batch_size=8", "eval.batch_size=32").eval.batch_size == 32


def test_the_fast_recipe_picks_muon_and_the_command_line_can_pick_another():
    fast = config_of("recipe=cifar10_fast")
    assert isinstance(fast.optim, schema.MuonConfig) and fast.optim.head_lr == 1340.0
    assert fast.perf.compile and fast.perf.cuda_graph and fast.perf.compile_mode is schema.CompileMode["default"]
    assert isinstance(config_of("recipe=cifar10_fast", "optim=sgd").optim, schema.SGDConfig)


def test_each_group_option_has_its_own_schema():
    assert isinstance(config_of("strategy=ddp", "strategy.static_graph=true").strategy, schema.DDPConfig)
    assert type(config_of("strategy=single").strategy) is schema.SingleConfig
    assert isinstance(config_of("backend=slurm", "backend.nodes=2").backend, schema.SlurmBackendConfig)
    # a key of another option is not a key of this one
    for override in (["strategy=single", "strategy.timeout_s=5"], ["backend=local", "backend.partition=gpu"],
                     ["optim=adamw", "optim.momentum=0.5"], ["recipe=digits", "recipe.tta=2"]):
        with pytest.raises(ConfigCompositionException):
            composed(*override)


def test_gpus_takes_lists_counts_and_words():
    assert list(composed("gpus=[0,1]").gpus) == [0, 1]
    assert composed("gpus=2").gpus == 2
    assert composed("gpus=all").gpus == "all"
    assert list(composed("gpus=[]").gpus) == []


@pytest.mark.parametrize("override", ["epoch=3", "recipe.modle=x", "strategy.bucket=1", "data.synth=true",
                                      "perf.cuda_grph=true"])
def test_typo_fails_at_compose_time(override):
    with pytest.raises(ConfigCompositionException):
        composed(override)


@pytest.mark.parametrize("override", ["epochs=abc", "batch_size=1.5", "lr=fast", "dry_run=maybe",
                                      "perf.precision=fp8", "recipe.flip=sometimes",
                                      "data.placement=disk", "progress=loud", "recipe.model=vgg",
                                      "perf.compile_mode=fast", "strategy.backend=mpi", "optim=lion"])
def test_wrong_type_or_choice_fails_at_compose_time(override):
    with pytest.raises(ConfigCompositionException):
        composed(override)


def test_choices_are_typed_by_name_torchs_spelling_included():
    cfg = config_of("perf.compile_mode=max-autotune-no-cudagraphs", "fault.rank=0", "fault.kind=nan",
                    "recipe.flip=alternating")
    assert cfg.perf.compile_mode.value == "max-autotune-no-cudagraphs" and cfg.fault.kind == "nan"
    assert cfg.recipe.flip is schema.Flip.alternating and str(cfg.recipe.flip) == "alternating"


@pytest.mark.parametrize("override, key", [
    ("epochs=0", "epochs"), ("batch_size=0", "batch_size"), ("lr=0", "lr"), ("lr=inf", "lr"), ("seed=-1", "seed"),
    ("nprocs=0", "nprocs"), ("max_restarts=-1", "max_restarts"), ("strategy.timeout_s=0", "strategy.timeout_s"),
    ("optim.momentum=1.5", "optim.momentum"), ("resume=true", "resume"), ("eval.every=-1", "eval.every"),
    ("recipe.translate=9", "recipe.translate"), ("data.prefetch_depth=0", "data.prefetch_depth"),
    ("fault.kind=explode", "fault.kind"),
])
def test_ranges_are_checked_with_one_line(override, key):
    with pytest.raises(ConfigError) as err:
        config_of(override)
    assert str(err.value).startswith(f"{key}=") and "\n" not in str(err.value)


def test_workers_get_a_typed_frozen_config_that_pickles():
    cfg = typed(composed("recipe=cifar10", "epochs=3"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.epochs = 4
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.recipe.tta = 1
    again = pickle.loads(pickle.dumps(cfg))
    assert again == cfg and again.recipe.model is schema.Cifar10Model.airbench
    changed = schema.derive(cfg, epochs=4)
    assert changed.epochs == 4 and cfg.epochs == 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        changed.epochs = 5
    assert schema.to_plain(cfg)["recipe"]["model"] == "airbench"


def test_a_resumed_text_run_evaluates_in_chunks_of_the_batch_it_trains_with(tmp_path, monkeypatch):
    """eval.batch_size follows batch_size (${batch_size}); a checkpoint holds the number. Resumed with a
    batch lowered to fit memory, the chunks follow it, unless the run had its own eval.batch_size."""
    import torch

    monkeypatch.chdir(tmp_path)
    saved = {"recipe": {"name": "text", "layers": 2}, "optim": {"name": "adamw"}, "batch_size": 64,
             "eval": {"batch_size": 64}, "epochs": 5}
    torch.save({"net_state_dict": {}, "epoch": 1, "config": saved}, "follows.pt")
    torch.save({"net_state_dict": {}, "epoch": 1, "config": {**saved, "eval": {"batch_size": 32}}}, "own.pt")
    assert (config_of("resume=follows.pt").eval.batch_size, config_of("resume=follows.pt").recipe.layers) == (64, 2)
    assert config_of("resume=follows.pt", "batch_size=8").eval.batch_size == 8
    assert config_of("resume=own.pt", "batch_size=8").eval.batch_size == 32
    assert config_of("resume=own.pt", "batch_size=8", "eval.batch_size=16").eval.batch_size == 16


def test_a_checkpoints_settings_are_taken_as_text_not_resolved_here(tmp_path, monkeypatch):
    """launch writes resolved configs; a `${oc.env:...}` in a checkpoint from elsewhere must not read this
    machine's environment into the resumed run's config."""
    import torch

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LAUNCH_TEST_SECRET", "leaked")
    saved = {"recipe": {"name": "text", "corpus": "${oc.env:LAUNCH_TEST_SECRET}"}, "optim": {"name": "adamw"},
             "epochs": 5}
    torch.save({"net_state_dict": {}, "epoch": 1, "config": saved}, "elsewhere.pt")
    assert config_of("resume=elsewhere.pt").recipe.corpus == "${oc.env:LAUNCH_TEST_SECRET}"


def test_a_relative_data_root_is_kept_as_the_folder_it_named(tmp_path, monkeypatch):
    """data.root=imgs names ./imgs where launch was typed: the run's config says so in full, so a resume or an
    eval typed from another folder still finds the data (a ~ path and an absolute one stay as typed)."""
    monkeypatch.chdir(tmp_path)
    assert config_of("recipe=digits", "data.root=imgs").data.root == str(tmp_path / "imgs")
    assert config_of("recipe=digits", "data.root=/data/x").data.root == "/data/x"
    assert config_of("recipe=digits", "data.root='~/x'").data.root == "~/x"


def test_a_refusal_is_said_with_the_commands_name_once():
    """Every refusal on the console starts "launch: "; a message that names the command typed ("launch eval
    RUN ...", "launch export RUN OUT ...") does not say it twice."""
    from launcher.errors import said

    assert said(ConfigError("epochs", 0, "must be at least 1")) == "launch: epochs=0 is not valid: must be at least 1"
    assert said("launch eval run bset is not valid: x") == "launch: eval run bset is not valid: x"
    assert said("launcher's own") == "launch: launcher's own"  # (only the word launch followed by a space)
