"""perf.compile (true | false | auto, decided after the first epoch) and the decoded-data cache."""

import os

import numpy as np
import pytest

from launcher.config import Toggle
from launcher.data import cache
from launcher.errors import ConfigError
from launcher.recipes import cifar10
from launcher.recipes.cifar10 import FOLDER, synthetic_splits, write_official_format
from launcher.train import compiling
from tests.conftest import config_of


def test_compile_setting_takes_true_false_auto_and_refuses_the_rest():
    assert config_of("recipe=cifar10").perf.compile is Toggle.auto
    assert config_of("recipe=cifar10", "perf.compile=true").perf.compile is Toggle.true
    assert config_of("recipe=cifar10_fast").perf.compile is Toggle.true
    assert config_of("perf.compile=false").perf.compile is Toggle.false
    with pytest.raises(ConfigError, match=r"perf.compile=often is not valid: choose true, false or auto"):
        config_of("perf.compile=often")
    with pytest.raises(ConfigError, match="perf.compile_auto_min_s"):
        config_of("perf.compile_auto_min_s=-1")


def test_auto_waits_for_the_first_epoch_on_gpus_and_never_compiles_on_the_cpu():
    assert compiling.decide(Toggle.true, "cpu").compile and not compiling.decide(Toggle.false, "cuda").compile
    assert not compiling.decide(Toggle.auto, "cpu").compile and not compiling.decide(Toggle.auto, "cpu").pending
    gpu = compiling.decide(Toggle.auto, "cuda")
    assert not gpu.compile and gpu.pending  # no compile before the first step


def test_auto_compiles_only_when_the_rest_of_the_run_earns_the_compile_back():
    short = compiling.after_first_epoch(epoch_s=0.2, epochs_left=9, min_seconds=60)  # the default cifar10 run
    assert not short.compile and "~2s" in short.why and "less than the 60s" in short.why
    long = compiling.after_first_epoch(epoch_s=0.45, epochs_left=199, min_seconds=60)
    assert long.compile and "~90s" in long.why
    assert compiling.after_first_epoch(0.5, 120, min_seconds=60).compile  # exactly at the bound


def test_cudnn_autotunes_when_the_run_compiles_unless_told():
    assert config_of("recipe=cifar10").perf.cudnn_benchmark is Toggle.auto
    assert config_of("recipe=digits").perf.cudnn_benchmark is Toggle.false
    assert config_of("recipe=cifar10", "perf.cudnn_benchmark=true").perf.cudnn_benchmark is Toggle.true
    with pytest.raises(ConfigError, match=r"perf.cudnn_benchmark=sometimes is not valid: choose true, false or auto"):
        config_of("perf.cudnn_benchmark=sometimes")
    auto, pending = Toggle.auto, compiling.decide(Toggle.auto, "cuda")
    assert not compiling.autotunes(auto, pending)  # the first epoch of an auto run: heuristics, no delay
    assert compiling.autotunes(auto, compiling.after_first_epoch(1.0, 100, min_seconds=60))
    assert not compiling.autotunes(auto, compiling.after_first_epoch(0.2, 9, min_seconds=60))
    assert compiling.autotunes(auto, compiling.decide(Toggle.true, "cuda"))
    assert compiling.autotunes(Toggle.true, pending)
    assert not compiling.autotunes(Toggle.false, compiling.decide(Toggle.true, "cuda"))


def test_caches_live_under_launch_cache_dir_unless_inductor_is_told_otherwise(tmp_path):
    env = {"LAUNCH_CACHE_DIR": str(tmp_path)}
    assert compiling.cache_dir(env) == tmp_path / "inductor"
    assert compiling.cache_dir({**env, "TORCHINDUCTOR_CACHE_DIR": "/x"}).as_posix() == "/x"
    assert cache.cache_root({"HOME": "/home/u"}).as_posix() == "/home/u/.cache/launcher"


def test_a_cache_key_changes_with_what_was_decoded_and_from_which_files(tmp_path):
    source = tmp_path / "batch"
    source.write_bytes(b"x")
    key = cache.key_for("synthetic", [source], train=500, test=100)
    assert key == cache.key_for("synthetic", [source], test=100, train=500)
    assert key != cache.key_for("synthetic", [source], train=600, test=100)  # (another size: other arrays)
    assert key != cache.key_for("cifar10", [source], train=500, test=100)
    source.write_bytes(b"xy")
    assert key != cache.key_for("synthetic", [source], train=500, test=100)


def test_a_dataset_is_decoded_once_and_read_back(tmp_path):
    calls = []

    def build():
        calls.append(1)
        return {"x": np.arange(12, dtype=np.uint8).reshape(3, 4), "y": np.array([1, 2, 3])}

    first = cache.cached("k", build, root=tmp_path)
    second = cache.cached("k", build, root=tmp_path)
    assert len(calls) == 1 and np.array_equal(first["x"], second["x"]) and np.array_equal(first["y"], second["y"])
    assert not list(tmp_path.rglob("*.tmp*"))  # nothing half-written left behind
    (tmp_path / "k" / "x.npy").write_bytes(b"damaged")
    assert np.array_equal(cache.cached("k", build, root=tmp_path)["x"], first["x"]) and len(calls) == 2


def test_the_inductor_cache_is_settled_before_torch_is_imported_and_a_users_unusable_one_refused(tmp_path):
    from launcher.errors import LaunchError

    env = {"LAUNCH_CACHE_DIR": str(tmp_path / "cache")}
    cache.prepare_inductor_dir(env)  # the launcher's default: made, and named for the workers
    assert env["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "cache" / "inductor")
    assert (tmp_path / "cache" / "inductor").is_dir()
    (tmp_path / "a-file").write_text("x")
    for unusable, why in ((tmp_path / "a-file", "it is a file, not a folder"),
                          (tmp_path / "a-file" / "below", "Not a directory")):
        env = {"TORCHINDUCTOR_CACHE_DIR": str(unusable)}
        with pytest.raises(LaunchError, match=f"TORCHINDUCTOR_CACHE_DIR={unusable} cannot hold .*{why}"):
            cache.prepare_inductor_dir(env)
    assert cache.why_unusable(tmp_path / "a-file" / "x" / "y") == f"{tmp_path / 'a-file'} is a file, not a folder"
    assert cache.why_unusable(tmp_path / "new" / "folder") is None and not (tmp_path / "new").exists()
    env = {"LAUNCH_CACHE_DIR": str(tmp_path / "a-file")}  # the default cannot be made (a read-only home):
    cache.prepare_inductor_dir(env)  # left to torch's own default, the run goes on
    assert "TORCHINDUCTOR_CACHE_DIR" not in env


def test_a_cache_that_cannot_be_written_costs_only_the_cache(tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    arrays = cache.cached("k", lambda: {"x": np.ones(3)}, root=blocked)
    assert arrays["x"].sum() == 3


def test_cifar10_reads_the_cache_and_decodes_again_when_its_files_change(tmp_path, monkeypatch):
    monkeypatch.setenv("LAUNCH_CACHE_DIR", str(tmp_path / "cache"))
    splits = synthetic_splits(50, 10, seed=5)
    write_official_format(tmp_path / FOLDER, splits)
    recipe = cifar10.Cifar10(config_of("recipe=cifar10", f"data.root={tmp_path}"))
    first = recipe.load()
    assert (first.train_x == splits.train_x).all() and (first.test_y == splits.test_y).all()
    assert len(list((tmp_path / "cache" / "decoded").iterdir())) == 1
    # a new data_batch_1 (another size): decoded again, never the stale arrays
    other = synthetic_splits(60, 10, seed=6)
    write_official_format(tmp_path / FOLDER, other)
    again = recipe.load()
    assert len(again.train_y) == 60 and (again.train_x == other.train_x).all()
    assert len(list((tmp_path / "cache" / "decoded").iterdir())) == 2
    # a new test_batch alone (the training batches untouched): the test set is decoded again too
    newer = synthetic_splits(60, 10, seed=7)
    write_official_format(tmp_path / "newer" / FOLDER, newer)
    (tmp_path / FOLDER / "test_batch").write_bytes((tmp_path / "newer" / FOLDER / "test_batch").read_bytes())
    third = recipe.load()
    assert (third.test_x == newer.test_x).all() and (third.train_x == other.train_x).all()
    assert not any(p.name.endswith(".npy") for p in (tmp_path / FOLDER).iterdir())  # the dataset's folder untouched


def test_the_compiled_model_trains_into_the_flat_gradients_and_evaluates_eagerly(monkeypatch):
    """compile_for_training (dynamo's eager backend here, inductor on GPUs): the model runs compiled in
    training mode only, as one graph, the state dict keeps its keys, and the gradients still land in
    the flat buffers a captured step all-reduces (their views stay the .grad tensors)."""
    import torch
    import torch._dynamo

    from launcher.recipes.vision_models import MODELS
    from launcher.strategies.gradients import FlatGradients

    torch._dynamo.reset()
    torch.manual_seed(0)
    model, reference = MODELS["airbench"](10), MODELS["airbench"](10)
    reference.load_state_dict(model.state_dict())
    keys = list(model.state_dict())
    grads = FlatGradients(model.parameters(), 1)
    frames = torch._dynamo.utils.counters["stats"]
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    compiling.compile_for_training(model, None, backend="eager")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(compiling.cache_dir())  # the launcher's cache
    x, y = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))
    for net in (model, reference):
        torch.nn.functional.cross_entropy(net(x), y).backward()
    assert frames["unique_graphs"] == 1  # the whole network, one graph
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert p.grad.data_ptr() == grads.views[p].data_ptr()
        assert torch.allclose(p.grad, q.grad, atol=1e-5)
    model.eval()
    reference.eval()
    assert torch.allclose(model(x[:3]), reference(x[:3]), atol=1e-5)
    assert frames["unique_graphs"] == 1  # evaluation did not compile
    assert list(model.state_dict()) == keys
