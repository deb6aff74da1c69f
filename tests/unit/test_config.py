"""The composed config: groups with a schema per option, recipe values, typos and wrong types failing at
compose time, range checks, and the typed, frozen config that workers get."""

import dataclasses
import pickle

import pytest
from hydra.errors import ConfigCompositionException

from launcher import config as schema
from launcher import errors as schema_errors
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
    assert cifar.optim.warmup_epochs == 2 and cifar.perf.cuda_graph is schema.Toggle.true
    assert cifar.eval.batch_size == 2048
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
    assert fast.perf.compile is fast.perf.cuda_graph is schema.Toggle.true
    assert fast.perf.compile_mode is schema.CompileMode["default"]
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
                                      "perf.precision=fp4", "recipe.flip=sometimes",
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
    ("fault.kind=explode", "fault.kind"), ("seed=2147483648", "seed"), ("recipe.translate=8", "recipe.translate"),
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


TOGGLES = ("perf.compile", "perf.cuda_graph", "perf.cudnn_benchmark")


@pytest.mark.parametrize("typed_as, meant", [("true", "true"), ("True", "true"), ("TRUE", "true"),
                                             ("false", "false"), ("False", "false"), ("auto", "auto"),
                                             ("AUTO", "auto"), ("Auto", "auto"), ("'true'", "true"),
                                             ("1", "true"), ("0", "false")])
def test_a_true_false_auto_key_reads_what_users_type_as_one_toggle(typed_as, meant):
    """Hydra reads `true` as a bool, `AUTO` as a string, `1` as an int: each reaches the code as the Toggle meant."""
    cfg = config_of(*(f"{key}={typed_as}" for key in TOGGLES))
    assert cfg.perf.compile is cfg.perf.cuda_graph is cfg.perf.cudnn_benchmark is schema.Toggle[meant]


def test_a_toggle_is_read_from_python_values_and_written_back_as_before():
    read = schema.Toggle.read
    assert read(True) is read("TRUE") is read(1) is read(1.0) is read(schema.Toggle.true) is schema.Toggle.true
    assert read(False) is read("False") is read(0) is schema.Toggle.false
    assert read("AUTO") is read("auto") is schema.Toggle.auto
    assert [read(v) for v in ("yes", "", " auto", 2, 0.5, None, [1])] == [None] * 7
    perf = schema.PerfConfig(compile=True, cuda_graph="AUTO", cudnn_benchmark=False)  # (constructed, not composed)
    assert (perf.compile, perf.cuda_graph, perf.cudnn_benchmark) == (schema.Toggle.true, schema.Toggle.auto,
                                                                     schema.Toggle.false)
    assert schema.derive(perf, cuda_graph=False).cuda_graph is schema.Toggle.false
    # config.yaml, checkpoints and trackers hold True, False and "auto", as launch always wrote them
    plain = schema.to_plain(perf)
    assert (plain["compile"], plain["cuda_graph"], plain["cudnn_benchmark"]) == (True, "auto", False)
    from launcher.host.compose import to_yaml

    written = to_yaml(config_of("recipe=cifar10_fast", "perf.cudnn_benchmark=auto"))
    assert "  compile: true\n" in written and "  cuda_graph: true\n" in written
    assert "  cudnn_benchmark: auto\n" in written


@pytest.mark.parametrize("key, value, said", [("perf.compile", "maybe", "maybe"), ("perf.cuda_graph", "yes", "yes"),
                                              ("perf.cudnn_benchmark", "2", "2"), ("perf.compile", "1.5", "1.5"),
                                              ("perf.cuda_graph", "null", "null"),
                                              ("perf.cudnn_benchmark", "[1]", "[1]")])
def test_a_bad_true_false_auto_value_is_one_line_naming_the_three(key, value, said):
    with pytest.raises(ConfigError) as err:
        config_of(f"{key}={value}")
    assert str(err.value).startswith(f"{key}={said} is not valid: choose true, false or auto (")
    assert str(err.value).endswith(f"(e.g. launch {key}=auto)") and "\n" not in str(err.value)


@pytest.mark.parametrize("value, read", [("2", "true"), ("-1", "true"), ("yes", "true"), ("on", "true"),
                                         ("y", "true"), ("no", "false"), ("off", "false")])
def test_a_true_false_key_given_another_number_or_word_is_one_line_not_read_as_true(value, read):
    """OmegaConf reads any number but 0, and yes, on or y, as true: `checkpoint.keep_previous=2` kept
    previous.pt. A true/false key takes what a true | false | auto key takes, but auto; a sweep's runs alike."""
    with pytest.raises(schema_errors.LaunchError) as err:
        config_of("checkpoint.keep_previous=" + value)
    assert str(err.value) == (f"checkpoint.keep_previous={value} is not valid: must be true or false (or 1 or 0; "
                              f"OmegaConf would read {value} as {read}) (e.g. launch checkpoint.keep_previous={read})")
    for fine, meant in (("TRUE", True), ("False", False), ("1", True), ("0", False)):
        assert config_of(f"checkpoint.keep_previous={fine}").checkpoint.keep_previous is meant
    assert config_of("recipe=text", "checkpoint.keep_previous=false", "recipe.sample_bytes=2").recipe.sample_bytes == 2


def test_a_checkpoint_written_with_bools_resumes_and_compares_its_settings_as_before(tmp_path, monkeypatch):
    """Checkpoints hold the true | false | auto keys as True, False and "auto" (to_plain): a resume reads them and
    names what this launch changes, and nothing where it types the same."""
    import torch

    from launcher.host.resume import inspect

    monkeypatch.chdir(tmp_path)
    saved = schema.to_plain(config_of("recipe=digits", "epochs=2", "perf.compile=true", "perf.cuda_graph=false"))
    assert (saved["perf"]["compile"], saved["perf"]["cuda_graph"], saved["perf"]["cudnn_benchmark"]) == (
        True, False, False)
    torch.save({"net_state_dict": {}, "epoch": 1, "config": saved}, "ck.pt")
    same = config_of("resume=ck.pt", "epochs=3", "perf.compile=True", "perf.cuda_graph=FALSE")
    assert same.perf.compile is schema.Toggle.true
    assert not [k for k in inspect("ck.pt", same).changed if k.startswith("perf.")]
    other = config_of("resume=ck.pt", "epochs=3", "perf.compile=auto", "perf.cuda_graph=false")
    assert {k: v for k, v in inspect("ck.pt", other).changed.items() if k.startswith("perf.")} == {
        "perf.compile": (True, "auto")}


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


def test_a_resume_carries_the_precision_but_not_the_speed_settings_or_a_typed_data_root(tmp_path, monkeypatch):
    """perf.* is where the run runs (not carried), except precision, which changes what is computed; the run's
    data folder is carried where it exists here, unless the command line names another."""
    import torch

    monkeypatch.chdir(tmp_path)
    (tmp_path / "theirs").mkdir()
    saved = {"recipe": {"name": "digits"}, "optim": {"name": "sgd"}, "epochs": 5,
             "perf": {"precision": "fp32", "compile_auto_min_s": 5.0}, "data": {"root": str(tmp_path / "theirs")}}
    torch.save({"net_state_dict": {}, "epoch": 1, "config": saved}, "ck.pt")
    cfg = config_of("resume=ck.pt")
    assert (str(cfg.perf.precision), cfg.perf.compile_auto_min_s) == ("fp32", 60.0)
    assert cfg.data.root == str(tmp_path / "theirs")
    assert config_of("resume=ck.pt", "data.root=mine").data.root == str(tmp_path / "mine")


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


@pytest.mark.parametrize("overrides, says", [
    (("+model.depth=3",), "model.depth=3 is not valid: sets an argument of a network from config, but model._target_"),
    (("early_stop.metric=val/loss", "eval.every=0", "epochs=3"), "early_stop.metric=val/loss is not valid: watches "
                                                                  "a held-out figure"),
    (("early_stop.patience=5",), "early_stop.metric=null is not valid: names no figure to watch"),
    (("checkpoint.enabled=false", "checkpoint.keep_best=2"), "checkpoint.keep_best=2 is not valid: keeps the best"),
    (("eval.checkpoint=run", "script=train.py"), "eval.checkpoint=run is not valid: evaluates a saved model; it "
                                                 "does not go with resume or script"),
])
def test_settings_that_would_do_nothing_or_contradict_each_other_are_refused(overrides, says):
    with pytest.raises(ConfigError) as err:
        config_of(*overrides)
    assert str(err.value).startswith(says)


def test_a_value_is_said_as_a_user_types_it_with_an_example_to_type():
    err = ConfigError("gpus", [0, 1], "GPU 1 does not exist", "gpus=[0]")
    assert str(err) == "gpus=[0,1] is not valid: GPU 1 does not exist (e.g. launch gpus=[0])"
    placement = ConfigError("data.placement", schema.Placement.gpu, "no GPU")
    assert str(placement) == "data.placement=gpu is not valid: no GPU"


# ---- what Hydra needs before it composes, and its errors in one line (compose.py, hydra_errors.py) ------

def test_a_key_added_with_a_plus_that_no_schema_has_is_refused_not_dropped():
    with pytest.raises(schema_errors.LaunchError, match=r"^\+epoch=\.\.\. is not valid: there is no key epoch to add "
                                                       r"\(did you mean epochs\?"):
        typed(composed("+epoch=3"))
    assert typed(composed("+args.lr=0.1")).args == {"lr": 0.1}  # (a section of the user's own keys)


def test_a_file_named_like_a_built_in_recipe_does_not_replace_it(tmp_path, monkeypatch):
    from launcher.host.compose import user_recipes_named

    monkeypatch.chdir(tmp_path)
    (tmp_path / "digits.py").write_text("# the user's notes, not a recipe\n")
    (tmp_path / "my_recipe.py").write_text("")
    assert user_recipes_named(["recipe=digits", "lr=0.1"]) == []
    assert user_recipes_named(["recipe=my_recipe"]) == ["my_recipe"]
    assert user_recipes_named(["-m", "recipe=my_pkg.mine,digits"]) == ["my_pkg.mine"]


def test_an_eval_run_dir_is_named_as_one_and_inside_torchrun_only_rank_0_writes_hydras_files(monkeypatch):
    import re

    from launcher.host.compose import _output_subdir, _run_name

    for key in ("TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "SLURM_STEP_ID"):
        monkeypatch.delenv(key, raising=False)
    assert re.fullmatch(r"\d{4}-\d\d-\d\d/\d\d-\d\d-\d\d-digits-eval-[0-9a-f]{4}", _run_name("digits", None, "ck.pt"))
    assert re.fullmatch(r".*-digits-[0-9a-f]{4}", _run_name("digits", None))
    assert _output_subdir() == ".hydra"
    world = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500",
             "TORCHELASTIC_RUN_ID": "x"}
    for key, value in world.items():
        monkeypatch.setenv(key, value)
    assert _output_subdir() is None and _run_name("digits", None) == "torchrun-x"
    monkeypatch.setenv("RANK", "0")
    assert _output_subdir() == ".hydra"


def said_for(*overrides: str) -> str:
    from launcher.host.hydra_errors import describe_hydra_error

    with pytest.raises(Exception) as err:
        typed(composed(*overrides))
    return str(err.value) if isinstance(err.value, schema_errors.LaunchError) else describe_hydra_error(err.value)


def test_a_misspelt_key_of_a_group_option_names_the_options_own_key():
    assert said_for("optim=sgd", "optim.momentun=0.5").startswith(
        "unknown key 'optim.momentun': did you mean optim.momentum? known keys: optim.name, optim.weight_decay")
    assert said_for("optim=adamw", "optim.momentum=0.5").startswith(
        "unknown key 'optim.momentum': it is an option of optim=muon or optim=sgd, not of optim=adamw")


def test_a_section_switched_off_by_true_or_false_says_how_to_set_its_keys():
    assert said_for("checkpoint=false", "checkpoint.keep_best=2").startswith(
        "checkpoint.keep_best is not valid beside checkpoint=true/false, which stands for the whole section")


def test_a_misspelt_section_is_suggested_only_where_the_key_exists_there():
    assert said_for("evl.every=2").startswith("unknown key 'evl.every': did you mean eval.every?")
    assert "did you mean" not in said_for("evl.nothing=2")


def test_checkpoint_true_or_false_beside_a_checkpoint_key_is_refused_in_either_order():
    """`checkpoint=false` stands for the whole section: after `checkpoint.keep_best=2` it dropped keep_best without
    a word (before it, Hydra refused); either order is now one line naming both and what to write (a new user's
    trial)."""
    from launcher.errors import LaunchError
    from launcher.host.compose import config_for

    with pytest.raises(LaunchError) as refused:
        config_for("recipe=digits", "checkpoint.keep_best=2", "checkpoint=false")
    assert str(refused.value) == ("checkpoint=false and checkpoint.keep_best=2 on one command line: checkpoint=true/"
                                  "false stands for the whole section, so the later would undo the earlier; write "
                                  "checkpoint.enabled=false beside checkpoint.keep_best instead, or leave one out")
    with pytest.raises((LaunchError, ConfigCompositionException)):
        config_for("recipe=digits", "checkpoint=false", "checkpoint.keep_best=2")
    assert config_for("recipe=digits", "checkpoint.enabled=false").checkpoint.enabled is False
    assert config_for("recipe=digits", "checkpoint=false").checkpoint.enabled is False
