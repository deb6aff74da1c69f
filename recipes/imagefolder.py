"""imagefolder: image classification on a folder in the ImageNet layout, any torchvision model (untrained).

    data.root/train/<class>/<image>      (subfolders of a class folder count too, as in torchvision)
    data.root/val/<class>/<image>

What is trained: `recipe.model`, torchvision's network of that name, untrained, on crops of
`recipe.image_size` (training: RandomResizedCrop(image_size, scale=(min_scale, 1)) and a random horizontal
flip, drawn per (seed, epoch, sample) so a resumed run repeats them; evaluation: the shorter side resized to
eval_resize, then a center crop), ImageNet-normalized, with cross-entropy (recipe.label_smoothing). Figures:
the launcher's loss and accuracy; throughput counts images.

On what data, through the data wing (launcher/data/):
- folders.py: `prepare` (in the launcher, once, before any worker) checks the layout with os.scandir only,
  no image opened: each problem one line and exit 2; linked paths left out (loops, second paths) said in one
  line. Classes are the class folders' names, sorted; samples as torchvision's ImageFolder sorts them.
- images.py: `load` returns the two Datasets (ImageFolderSplit); the launcher's DataLoader workers read them
  (loader.py) and decode each crop with PIL, or hand it over for the GPU; `collate` batches both kinds.
- gpu_decode.py: `on_after_batch_transfer` (on the launcher's side stream, from its prefetch thread) decodes
  the batch's JPEGs on the GPU where `data.decode` says so, and crops, resizes, flips and normalizes it.
- decode_trial.py: data.decode=auto measures in the run whether the workers alone keep up with the steps
  or each batch is better split between them and the GPU's decoder (fed by the loader, not by this recipe).

`data.decode`: cpu (the workers decode), gpu (JPEGs on the GPU, other files by the workers), auto (on CUDA
the faster of the two, measured; without CUDA: cpu; data.decode=gpu without CUDA says so and decodes on the
CPU). A file that cannot be read or decoded stops the run with one line naming it (data.on_bad_file=error),
or is left out of its batch and counted by the launcher (skip).

Hyper-parameters: ImageFolderConfig in launcher/config.py; values: conf/recipe/imagefolder.yaml.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from launcher.config import ImageFolderConfig
from launcher.data.decode_trial import DecodeTrial
from launcher.data.folders import left_out_line, scan
from launcher.data.gpu_decode import Normalizer, decode_plan, gpu_batch, resizes_on_gpu
from launcher.data.images import ImageFolderSplit, collate
from launcher.data.loader import rank_workers
from launcher.data.slots import PinnedSlots, batch_slots
from launcher.recipes import Recipe


def data_root(cfg) -> Path:
    return Path(os.path.expanduser(str(cfg.data.root)))


class ImageFolder(Recipe):
    Config = ImageFolderConfig
    hp: ImageFolderConfig
    unit = "images"

    def __init__(self, cfg):
        super().__init__(cfg)
        self.decode = "cpu"  # where this worker's batches are decoded (decided in load)
        self.trial: DecodeTrial | None = None  # data.decode=auto's measured choice (load; the loader feeds it)
        self._slots: PinnedSlots | None = None  # the training batches' shared buffers (load, under Regions)
        self._normalize = Normalizer(bool(cfg.perf.channels_last))
        self._classes: tuple[str, ...] | None = None  # the class folders' names (prepare, in the launcher)

    def prepare(self) -> None:
        """Check the folder's layout (in the launcher, once; no image is opened), and say what linked paths
        the scan left out."""
        root = data_root(self.cfg)
        folders = scan(root)
        self._classes = tuple(folders["train"].classes)
        said = left_out_line(root, folders)
        if said:
            print(f"launch: warning: {said}", file=sys.stderr, flush=True)

    def data_classes(self) -> tuple[str, ...]:
        """The class folders' sorted names (scanned by `prepare`): a checkpoint's outputs are these classes."""
        if self._classes is None:
            self._classes = tuple(scan(data_root(self.cfg))["train"].classes)
        return self._classes

    def decode_plan(self, cuda: bool) -> tuple[str, float]:
        """(cpu | gpu | auto, the share of samples meant for the GPU decoder), said in one log line, for this
        rank's DataLoader workers (launcher/data/gpu_decode.py)."""
        return decode_plan(str(self.cfg.data.decode), cuda, rank_workers(self.cfg.data), self.cfg.epochs)

    def batch_slots(self) -> PinnedSlots | None:
        """Shared, page-locked buffers for the training batches of Regions (launcher/data/slots.py), each slot
        twice a batch of decoded crops (a batch of Regions averaged a little under that on the generated
        ImageNet-like folder; measured: BENCHMARKS.md section 12); None without workers, or where that memory
        cannot be had."""
        nbytes = 2 * int(self.cfg.batch_size) * self.hp.image_size ** 2 * 3
        return batch_slots(rank_workers(self.cfg.data), int(self.cfg.data.worker_prefetch), nbytes)

    def load(self) -> tuple[ImageFolderSplit, ImageFolderSplit]:
        folders = scan(data_root(self.cfg))
        self.decode, gpu_share = self.decode_plan(torch.cuda.is_available())
        common = dict(image_size=self.hp.image_size, eval_resize=self.hp.eval_side, min_scale=self.hp.min_scale,
                      seed=self.cfg.seed, gpu_share=gpu_share, skip_bad=str(self.cfg.data.on_bad_file) == "skip",
                      regions=self.decode != "cpu" and resizes_on_gpu())
        splits = (ImageFolderSplit(folders["train"], train=True, **common),
                  ImageFolderSplit(folders["val"], train=False, **common))
        if common["regions"]:
            splits[0].slots = self._slots = self.batch_slots()
        if self.decode == "auto" and gpu_share < 1.0:
            # The first epoch's batches do not pace the run: they span compiling (perf.compile=auto decides at
            # its end), the warm-up, the workers' start (on two H200s the first epoch ran at a third of the
            # others' speed, and the workers alone timed there came out far slower than the steps; measured:
            # BENCHMARKS.md section 12). So the trial times the second epoch's.
            later = self.cfg.epochs > 1
            self.trial = DecodeTrial(splits, start_after=len(splits[0]) // max(1, int(self.cfg.batch_size))
                                     if later else 0)
        return splits

    def collate(self, samples: list[Any]) -> Any:
        return collate(samples)

    def on_after_batch_transfer(self, batch: Any, training: bool) -> Any:
        if len(batch) == 4:  # some samples still to decode or resize (see launcher/data/images.py collate)
            return gpu_batch(batch, self.hp.image_size, str(self.cfg.data.on_bad_file) == "skip", self._normalize,
                             self._slots)
        x, labels = batch
        return self._normalize(x), labels

    def loss(self) -> nn.Module:
        return nn.CrossEntropyLoss(label_smoothing=self.hp.label_smoothing)

    def build_model(self, num_classes: int) -> nn.Module:
        import torchvision

        kwargs: dict[str, Any] = {"weights": None, "num_classes": num_classes}
        name = self.hp.model
        if name in ("googlenet", "inception_v3"):  # their auxiliary heads would make the output a tuple
            kwargs.update(aux_logits=False, init_weights=True)
        if name.startswith("vit_"):
            kwargs["image_size"] = self.hp.image_size
        return torchvision.models.get_model(name, **kwargs)
