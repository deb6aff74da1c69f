"""CIFAR-10 loading from the official python format, archive checks, download, and the offline message."""

import hashlib
import io
import tarfile

import pytest
import torch

from launcher.recipes import cifar10
from launcher.recipes.cifar10 import (
    ARCHIVE,
    FOLDER,
    DataError,
    ensure_extracted,
    synthetic_splits,
    write_official_format,
)
from tests.conftest import config_of


def cfg_for(root, synthetic=False, download=False):
    return config_of("recipe=cifar10", f"data.root={root}", f"data.synthetic={str(synthetic).lower()}",
                     f"data.download={str(download).lower()}")


def recipe_for(root, **kw) -> cifar10.Cifar10:
    return cifar10.Cifar10(cfg_for(root, **kw))


def make_archive(tmp_path, n_train=50, n_test=10):
    src = tmp_path / "src"
    splits = synthetic_splits(n_train, n_test, seed=7)
    write_official_format(src / FOLDER, splits)
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        tar.add(src / FOLDER, arcname=FOLDER)
    data = buffer.getvalue()
    return data, hashlib.md5(data).hexdigest(), splits


def test_official_format_round_trip(tmp_path):
    splits = synthetic_splits(60, 20, seed=1)
    write_official_format(tmp_path / FOLDER, splits)
    loaded = recipe_for(tmp_path).load()
    assert torch.equal(loaded.train_x, splits.train_x) and torch.equal(loaded.train_y, splits.train_y)
    assert torch.equal(loaded.test_x, splits.test_x) and loaded.train_x.dtype == torch.uint8
    assert loaded.train_x.shape == (60, 3, 32, 32) and not loaded.synthetic


def test_archive_is_checked_and_extracted(tmp_path):
    data, md5, splits = make_archive(tmp_path)
    root = tmp_path / "root"
    root.mkdir()
    (root / ARCHIVE).write_bytes(data)
    folder = ensure_extracted(root, download=False, md5=md5)
    assert (folder / "data_batch_5").is_file() and (folder / "test_batch").is_file()


def test_damaged_archive_says_so(tmp_path):
    (tmp_path / ARCHIVE).write_bytes(b"not a tarball")
    with pytest.raises(DataError, match="damaged or not the official archive"):
        ensure_extracted(tmp_path, download=False)


def test_download_checks_the_checksum_and_extracts(tmp_path):
    data, md5, _ = make_archive(tmp_path)
    served = tmp_path / "served.tar.gz"
    served.write_bytes(data)
    root = tmp_path / "root"
    ensure_extracted(root, download=True, url=served.as_uri(), md5=md5)
    assert (root / FOLDER / "data_batch_1").is_file()
    assert not list(root.glob("*.part"))


def test_offline_message_says_where_to_put_the_archive(tmp_path):
    with pytest.raises(DataError) as err:
        ensure_extracted(tmp_path / "root", download=True, url="http://127.0.0.1:9/cifar-10-python.tar.gz")
    text = str(err.value)
    assert "\n" not in text and ARCHIVE in text and str(tmp_path / "root") in text and "data.synthetic=true" in text
    assert not list((tmp_path / "root").glob("*"))  # no partial file left behind


def test_missing_without_download(tmp_path):
    with pytest.raises(DataError, match=r"CIFAR-10 not found: put cifar-10-python.tar.gz"):
        recipe_for(tmp_path).prepare()


def test_synthetic_is_only_used_when_asked(tmp_path):
    recipe_for(tmp_path, synthetic=True).prepare()  # no data needed
    with pytest.raises(DataError):
        recipe_for(tmp_path, synthetic=False).load()
    small = synthetic_splits(100, 10)
    assert small.synthetic and small.train_x.shape == (100, 3, 32, 32)


def test_evaluation_averages_the_test_time_augmentation_asked_for(tmp_path):
    """recipe.tta=2: the logits are the weighted mean over the mirror and the shifted views, not one forward."""
    from launcher.data.augment import tta_logits

    def by_position(v):  # a network that reads pixels by position: every view gives other logits
        return v[:, 0, 0, :4]

    x = torch.randn(3, 3, 8, 8)
    for tta in (0, 1, 2):
        recipe = cifar10.Cifar10(config_of("recipe=cifar10", f"recipe.tta={tta}"))
        assert torch.equal(recipe.predict(by_position, x), tta_logits(by_position, x, tta))
    assert not torch.allclose(cifar10.Cifar10(config_of("recipe=cifar10", "recipe.tta=2")).predict(by_position, x),
                              by_position(x))
