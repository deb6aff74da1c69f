"""cifar10: CIFAR-10 (Krizhevsky 2009) from the official python-format archive, or generated stand-in data.

Data is looked for under `data.root`: an extracted `cifar-10-batches-py/`, else the archive
`cifar-10-python.tar.gz` (checked against its published MD5, then extracted), else it is downloaded
when `data.download=true` and the network allows. Offline, one line says where to put the archive.
`data.synthetic=true` generates learnable CIFAR-shaped data for timing runs; it is never used unless asked.
Either is decoded (or generated) once and then read from launch's data cache (launcher/data/cache.py).
Hyper-parameters: Cifar10Config in launcher/config.py; values: conf/recipe/cifar10.yaml and
conf/recipe/cifar10_fast.yaml (the record-speed configuration of the same recipe).
"""

from __future__ import annotations

import hashlib
import os
import pickle
import tarfile
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import torch
from torch import nn

from launcher.config import Cifar10Config
from launcher.data import cache
from launcher.data.augment import image_augmentation, tta_logits
from launcher.errors import LaunchError
from launcher.recipes import Augment, Recipe, Splits
from launcher.recipes.vision_models import MODELS

URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
ARCHIVE = "cifar-10-python.tar.gz"
ARCHIVE_MD5 = "c58f30108f718f92721af3b95e74349a"
FOLDER = "cifar-10-batches-py"
TRAIN_FILES = [f"data_batch_{i}" for i in range(1, 6)]
TEST_FILE = "test_batch"
# Per-channel mean and std of the training set, in 0..255 pixel units.
MEAN = (125.307, 122.950, 113.865)
STD = (62.993, 62.089, 66.705)
SYNTHETIC_SIZES = (50_000, 10_000)


class DataError(LaunchError):
    """The dataset is missing or damaged; the message says what to do."""


def data_root(cfg) -> Path:
    return Path(os.path.expanduser(str(cfg.data.root)))


def ensure_extracted(root: Path, download: bool, url: str = URL, md5: str = ARCHIVE_MD5) -> Path:
    folder = root / FOLDER
    if all((folder / name).is_file() for name in [*TRAIN_FILES, TEST_FILE]):
        return folder
    archive = root / ARCHIVE
    if not archive.is_file():
        if not download:
            raise DataError(f"CIFAR-10 not found: put {ARCHIVE} ({url}) or its extracted {FOLDER}/ in {root}, "
                            "or set data.root=DIR; data.synthetic=true runs on generated data for timing")
        _download(url, archive, md5)
    digest = _md5(archive)
    if digest != md5:
        raise DataError(f"{archive} is damaged or not the official archive (MD5 {digest}, expected {md5}): "
                        f"delete it and download it again from {url}")
    _extract(archive, root)
    return folder


def _download(url: str, archive: Path, md5: str) -> None:
    from tqdm.auto import tqdm

    archive.parent.mkdir(parents=True, exist_ok=True)
    partial = archive.with_name(archive.name + ".part")
    try:
        with urllib.request.urlopen(url, timeout=30) as response, open(partial, "wb") as out:
            total = int(response.headers.get("Content-Length") or 0) or None
            with tqdm(total=total, unit="B", unit_scale=True, desc=f"downloading {archive.name}") as bar:
                while chunk := response.read(1 << 20):
                    out.write(chunk)
                    bar.update(len(chunk))
    except (urllib.error.URLError, OSError, TimeoutError) as exc:
        partial.unlink(missing_ok=True)
        reason = getattr(exc, "reason", exc)
        raise DataError(f"CIFAR-10 is not in {archive.parent} and downloading {url} failed ({reason}): "
                        f"put {archive.name} (MD5 {md5}) there by hand, or set data.root=DIR where it is; "
                        "data.synthetic=true runs on generated data for timing") from None
    os.replace(partial, archive)


def _md5(path: Path) -> str:
    digest = hashlib.md5()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def _extract(archive: Path, root: Path) -> None:
    with tarfile.open(archive, "r:gz") as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(FOLDER + "/") and m.isfile()]
        for member in members:  # only plain files inside the one folder: nothing escapes data.root
            if ".." in Path(member.name).parts:
                raise DataError(f"{archive} holds an unsafe path {member.name!r}: delete it")
        if hasattr(tarfile, "data_filter"):  # refuses links, devices and absolute paths as well
            tar.extractall(root, members=members, filter="data")
        else:
            tar.extractall(root, members=members)


def _read_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    with open(path, "rb") as f:
        batch = pickle.load(f, encoding="bytes")
    images = np.asarray(batch[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32)
    labels = np.asarray(batch[b"labels"], dtype=np.int64)
    return images, labels


def load_official(root: Path) -> Splits:
    folder = ensure_extracted(root, download=False)
    parts = [_read_batch(folder / name) for name in TRAIN_FILES]
    train_x = torch.from_numpy(np.concatenate([p[0] for p in parts]))
    train_y = torch.from_numpy(np.concatenate([p[1] for p in parts]))
    test_x, test_y = (torch.from_numpy(a) for a in _read_batch(folder / TEST_FILE))
    return Splits(train_x, train_y, test_x, test_y, 10, MEAN, STD)


def synthetic_splits(n_train: int, n_test: int, seed: int = 0) -> Splits:
    """CIFAR-shaped uint8 data a network can learn: each class is a smooth colour pattern plus noise.

    For timing runs on machines without the dataset. Accuracy on it says nothing about CIFAR-10.
    """
    g = torch.Generator().manual_seed(seed)
    coarse = torch.rand(10, 3, 4, 4, generator=g)
    templates = nn.functional.interpolate(coarse, size=(32, 32), mode="bilinear", align_corners=False) * 255

    def make(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        labels = torch.randint(0, 10, (n,), generator=g)
        images = torch.empty(n, 3, 32, 32, dtype=torch.uint8)
        for start in range(0, n, 10_000):  # chunks keep the float scratch memory small
            y = labels[start:start + 10_000]
            noise = torch.randn(len(y), 3, 32, 32, generator=g) * 60
            images[start:start + 10_000] = (templates[y] * 0.6 + 50 + noise).clamp(0, 255).to(torch.uint8)
        return images, labels

    train_x, train_y = make(n_train)
    test_x, test_y = make(n_test)
    return Splits(train_x, train_y, test_x, test_y, 10, MEAN, STD, synthetic=True)


def write_official_format(folder: Path, splits: Splits, per_batch: int | None = None) -> None:
    """Write images in the official python format (5 training batches, a test batch, batches.meta).

    Used by the tests to build small stand-ins for the real archive.
    """
    folder.mkdir(parents=True, exist_ok=True)
    n = len(splits.train_y)
    per_batch = per_batch or -(-n // 5)
    names = [b"airplane", b"automobile", b"bird", b"cat", b"deer", b"dog", b"frog", b"horse", b"ship", b"truck"]

    def dump(name: str, x: torch.Tensor, y: torch.Tensor) -> None:
        record = {b"batch_label": name.encode(), b"labels": y.tolist(),
                  b"data": x.reshape(len(x), -1).numpy(), b"filenames": [b"img%d.png" % i for i in range(len(x))]}
        with open(folder / name, "wb") as f:
            pickle.dump(record, f)

    for i, name in enumerate(TRAIN_FILES):
        sl = slice(i * per_batch, min(n, (i + 1) * per_batch))
        dump(name, splits.train_x[sl], splits.train_y[sl])
    dump(TEST_FILE, splits.test_x, splits.test_y)
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump({b"label_names": names, b"num_cases_per_batch": per_batch, b"num_vis": 3072}, f)


def _arrays(splits: Splits) -> dict[str, np.ndarray]:
    return {"train_x": splits.train_x.numpy(), "train_y": splits.train_y.numpy(), "test_x": splits.test_x.numpy(),
            "test_y": splits.test_y.numpy()}


def _splits(arrays: dict[str, np.ndarray], synthetic: bool = False) -> Splits:
    t = {name: torch.from_numpy(array) for name, array in arrays.items()}
    return Splits(t["train_x"], t["train_y"], t["test_x"], t["test_y"], 10, MEAN, STD, synthetic=synthetic)


class Cifar10(Recipe):
    class_names = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
    Config = Cifar10Config
    hp: Cifar10Config

    def prepare(self) -> None:
        """Make sure the extracted batches exist under data.root (in the launcher, once)."""
        if not self.cfg.data.synthetic:
            ensure_extracted(data_root(self.cfg), download=self.cfg.data.download)

    def load(self) -> Splits:
        """The splits, decoded (or generated) once and then read from launch's data cache (launcher/data/cache.py)."""
        if self.cfg.data.synthetic:
            key = cache.key_for("cifar10-synthetic", sizes=SYNTHETIC_SIZES, seed=0)
            arrays = cache.cached(key, lambda: _arrays(synthetic_splits(*SYNTHETIC_SIZES, seed=0)))
            return _splits(arrays, synthetic=True)
        folder = ensure_extracted(data_root(self.cfg), download=False)
        key = cache.key_for("cifar10", [folder / name for name in [*TRAIN_FILES, TEST_FILE]])
        return _splits(cache.cached(key, lambda: _arrays(load_official(data_root(self.cfg)))))

    def augmentation(self) -> Augment | None:
        # flips and shifts on the device, as recipe.flip / recipe.translate say
        return image_augmentation(self.hp, self.cfg.seed) if self.hp.augment else None

    def loss(self) -> nn.Module:
        return nn.CrossEntropyLoss(label_smoothing=self.hp.label_smoothing)

    def build_model(self, num_classes: int) -> nn.Module:
        return MODELS[self.hp.model.value](num_classes)

    def prepare_model(self, model: nn.Module, sample: torch.Tensor) -> None:
        if hasattr(model, "init_whitening"):
            model.init_whitening(sample)

    def predict(self, net: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return tta_logits(net, x, self.hp.tta)
