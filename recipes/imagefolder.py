"""imagefolder: image classification on a folder in the ImageNet layout, any torchvision model (untrained).

    data.root/train/<class>/<image>      (subfolders of a class folder count too, as in torchvision)
    data.root/val/<class>/<image>

Linked folders are followed, each folder and image read once per split: a link back to a folder above it
and a second path to what was read already are left out, said in one line by `prepare` (_SplitWalk).

Images are the files ending .jpg .jpeg .png .bmp .webp (any case); other files and hidden ones (a name
starting with a dot: .DS_Store, ._x.jpg, .ipynb_checkpoints/) are ignored. Classes are the class folders'
names, sorted; samples are sorted like torchvision's ImageFolder, so indices and labels match it.

`prepare` (in the launcher, once, before any worker) checks the layout with os.scandir only, no image is
opened: each problem is one line and exit 2. `load` returns the two Datasets; the launcher's DataLoader
workers call them. Where the images are decoded is `data.decode`:

  cpu   the worker decodes with PIL (JPEGs at reduced size via `draft` when the crop allows), converts any
        mode to RGB, crops (training: RandomResizedCrop(image_size, scale=(min_scale, 1)) + a random
        horizontal flip; evaluation: the shorter side resized to eval_resize, then a center crop; resized
        by torch's antialiased uint8 kernel, PIL's filter at about half its cost), and hands over uint8 CHW
        crops. The GPU only normalizes them.
  gpu   the worker reads the file's bytes and the JPEG's header (its size) and draws the crop box;
        `on_after_batch_transfer` (on the launcher's side stream, from its prefetch thread) decodes the
        batch's JPEGs on the GPU (nvImageCodec on the hardware JPEG engines where installed, the batch split
        between two decoders; else one batched nvJPEG call, torchvision.io.decode_jpeg on the device), then
        one Triton kernel (image_kernels.py) crops and resizes every image straight from the decoder's
        buffers (roi_align's adaptive sampling: an antialiased downscale), flips and normalizes it into the
        batch. Files nvJPEG cannot or should not take (PNG, BMP, WebP, grey, CMYK and progressive JPEGs, a
        JPEG without its end marker) are decoded by the worker as for cpu; the batch carries both kinds.
        On CUDA (where image_kernels runs) the worker does not resize what it decodes: it hands over the
        pixels around the crop box (at draft's reduced size) as a Region, the batch's Regions one after
        another in one buffer (a PinnedSlots slot for training batches: launcher/data/slots.py), and the
        same kernel resizes them on the GPU. The resize was a third of a sample's host time (0.6 of 1.8 ms).
  auto  on CUDA, measured in the run (DecodeTrial): the first training batches of the second epoch (the
        first one's pace is not the run's: compiling, the warm-up, the workers starting) are decoded by the
        workers alone and timed, by the steps' own time on the GPU's clock, by the time the workers need
        for a batch (their stock of batches made ahead cannot hide that they do not keep up) and by the
        prefetch thread's. Where they keep up, that is all. Where they fall behind, each batch is split:
        the share the workers make in a step's time stays with them, the rest goes to the GPU's decoder;
        timed the same way, and balanced once more by its own times where they are still apart. The
        fastest way is kept, said in one line with every figure.
        The workers' crops are resized on the GPU as under gpu. Without CUDA: cpu. data.decode=gpu without
        CUDA says so in one line and decodes on the CPU.

Augmentation is drawn per sample from (seed, epoch, sample index), so a resumed run repeats it: the
launcher tells the dataset the epoch with `set_epoch(epoch)` in the process that reads a batch, before its
first batch of that epoch (the epoch travels with the batch's indices, so workers may read the next
epoch's first batches while this one's last ones train: launcher/data/loader.py). Until it is told, the
draw mixes in the DataLoader's per-epoch base seed instead of the epoch (new crops every epoch, repeated on
resume only as far as that seed is).

A file that cannot be read or decoded stops the run with one line naming it (data.on_bad_file=error), or
is left out of its batch and counted by the launcher (skip: the Dataset returns None for it).

Hyper-parameters: ImageFolderConfig in launcher/config.py; values: conf/recipe/imagefolder.yaml.
"""

from __future__ import annotations

import io
import logging
import math
import os
import random
import stat as stat_module
import statistics
import sys
import time
import warnings
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch import nn

from launcher.config import ImageFolderConfig
from launcher.data.slots import PinnedSlots
from launcher.errors import ConfigError, LaunchError
from launcher.recipes import Recipe

log = logging.getLogger("launcher.train")

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".webp")
SPLITS = ("train", "val")
# ImageNet's per-channel mean and std, in 0..255 pixel units
MEAN = (0.485 * 255, 0.456 * 255, 0.406 * 255)
STD = (0.229 * 255, 0.224 * 255, 0.225 * 255)
WORK_SLOTS = 1025  # rows of ImageFolderSplit's work counts: one per DataLoader worker (data.workers <= 1024), one more
EXAMPLE = "recipe=imagefolder data.root=/data/imagenet"


class BadImageError(LaunchError):
    """An image that cannot be read or decoded (data.on_bad_file=error). One line naming the file, also
    when a DataLoader worker raised it (the loader re-raises it with the worker's traceback in the message;
    this class keeps only the last line of it)."""

    def __init__(self, message: str):
        text = str(message)
        if "Traceback" in text:  # torch.utils.data's ExceptionWrapper.reraise: "Caught ... Original Traceback"
            last = [line for line in text.strip().splitlines() if line.strip()][-1]
            prefix = f"{type(self).__name__}: "
            text = last.split(prefix, 1)[1] if prefix in last else last
        super().__init__(text)


def bad_file(path: str, exc: BaseException) -> BadImageError:
    reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return BadImageError(f"{path} cannot be decoded as an image ({type(exc).__name__}: {reason}): remove or replace "
                         "it, or data.on_bad_file=skip to leave such files out (counted in the epoch line)")


# ---- the folder ---------------------------------------------------------------------------------------------


_SKIPPED: set[str] = set()  # the files this process said it left out (data.on_bad_file=skip)


def said_skipped(path: str, exc: BaseException) -> None:
    """data.on_bad_file=skip: name a file left out, once per process that reads it (the launcher counts them)."""
    if path not in _SKIPPED:
        _SKIPPED.add(path)
        reason = str(exc).strip().splitlines()[0][:120] if str(exc).strip() else ""
        log.warning("data.on_bad_file=skip: left out %s (%s%s)", path, type(exc).__name__,
                    f": {reason}" if reason else "")


def data_root(cfg) -> Path:
    return Path(os.path.expanduser(str(cfg.data.root)))


def _is_image(name: str) -> bool:
    return not name.startswith(".") and name.lower().endswith(IMAGE_SUFFIXES)


def _class_folders(split: Path) -> list[str]:
    with os.scandir(split) as entries:
        return sorted(e.name for e in entries if not e.name.startswith(".") and e.is_dir())


@dataclass
class LeftOut:
    """The linked paths a split's scan did not follow: loops (a link to the folder it is in or to one above
    it) and second paths to a folder or image read already (under its real path, kept)."""

    loops: list[str] = field(default_factory=list)
    again: list[tuple[str, str]] = field(default_factory=list)  # (the path left out, the path it was read under)

    def __len__(self) -> int:
        return len(self.loops) + len(self.again)


class _SplitWalk:
    """One split's class folders listed as os.walk(followlinks=True) lists them, but each folder and image read
    once. os.walk followed a link to a folder above it 40 levels deep (12 images read as 492 samples; two such
    links never end), and read a second path to a folder or file again. Here the real folders come first, then
    the links found in them (round after round: links inside linked folders); a linked folder already read
    (by device and inode) or a linked image whose real path was read is left out, in `left_out`."""

    def __init__(self, split: Path):
        self.dirs: dict[tuple[int, int], str] = {}  # each folder read (device, inode) -> the path read
        self.names: dict[tuple[int, int], set[str]] = {}  # the images read in each folder, by its identity
        self.linked_files: set[str] = set()  # real paths of the images read through a link
        self.found: dict[str, tuple[int, list[str]]] = {}  # folder path -> (class index, its images' names)
        self.links: list[tuple[int, str]] = []  # (class index, path) of the links the next round follows
        self.left_out = LeftOut()
        self.roots_left: dict[int, str] = {}  # a class folder that is itself left out -> the path it leads to
        st = os.stat(split)
        self.dirs[(st.st_dev, st.st_ino)] = str(split)  # (a link to the split itself is a loop)

    def run(self, roots: list[tuple[int, str]]) -> list[list[str]]:
        """The image paths of each class (index order), sorted as torchvision's ImageFolder sorts them: folder
        by folder in sorted order of the folders' paths, each folder's files by name."""
        for label, path in sorted(roots, key=lambda r: os.path.islink(r[1])):  # real class folders first
            self._enter(label, path, root=True)
        while self.links:
            pending, self.links = sorted(self.links, key=lambda r: r[1]), []
            files = []
            for label, path in pending:  # linked folders of this round first, then linked files
                try:
                    st = os.stat(path)
                except OSError:  # dangling, or a link to itself: a file as os.walk lists it (named when read)
                    st = None
                if st is not None and stat_module.S_ISDIR(st.st_mode):
                    self._enter(label, path)
                else:
                    files.append((label, path))
            for label, path in files:
                self._linked_file(label, path)
        per_class: list[list[str]] = [[] for _ in roots]
        for folder, (label, names) in sorted(self.found.items()):
            per_class[label].extend(os.path.join(folder, name) for name in sorted(names))
        return per_class

    def _enter(self, label: int, top: str, root: bool = False) -> None:
        """Read the folder `top` and the real folders under it; the links in them wait for the next round."""
        stack = [top]
        while stack:
            folder = stack.pop()
            st = os.stat(folder)
            key = (st.st_dev, st.st_ino)
            first = self.dirs.get(key)
            if first is not None:
                real, parent = os.path.realpath(folder), os.path.realpath(os.path.dirname(folder))
                if parent == real or parent.startswith(real.rstrip(os.sep) + os.sep):
                    self.left_out.loops.append(folder)
                else:
                    self.left_out.again.append((folder, first))
                if root:
                    self.roots_left[label] = first
                continue
            self.dirs[key] = folder
            names: list[str] = []
            with os.scandir(folder) as entries:
                for e in entries:
                    if e.name.startswith("."):
                        continue
                    if e.is_symlink():
                        self.links.append((label, e.path))
                    elif e.is_dir(follow_symlinks=False):
                        stack.append(e.path)
                    elif _is_image(e.name):
                        names.append(e.name)
            self.names[key] = set(names)
            self.found[folder] = (label, names)

    def _linked_file(self, label: int, path: str) -> None:
        """A link to a file: an image unless its target was read already (really there, or through a link)."""
        folder, name = os.path.split(path)
        if not _is_image(name):
            return
        real = os.path.realpath(path)
        try:
            st = os.stat(os.path.dirname(real))
            there = os.path.basename(real) in self.names.get((st.st_dev, st.st_ino), ())
        except OSError:
            there = False
        if there or real in self.linked_files:
            self.left_out.again.append((path, real))
            return
        self.linked_files.add(real)
        self.found[folder][1].append(name)


def _listing(names: list[str], limit: int = 5) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" (and {len(names) - limit} more)" if len(names) > limit else "")


@dataclass
class Folder:
    """One split: its classes (sorted folder names) and samples (path, class index), in ImageFolder's order."""

    classes: list[str]
    samples: list[tuple[str, int]]
    left_out: LeftOut = field(default_factory=LeftOut)  # linked paths not followed (loops, second paths)


def scan(root: Path) -> dict[str, Folder]:
    """Both splits of `root`, checked: a ConfigError naming data.root and the problem, one line each. Reads
    directory entries only (os.scandir; no image is opened): ~2.5 s per 10^6 files on a local disk."""
    key = "data.root"
    if not root.is_dir():
        what = "is a file, not a folder" if root.exists() else "no such folder"
        raise ConfigError(key, root, f"{what}: recipe=imagefolder reads DIR/train/<class>/<image> and "
                          "DIR/val/<class>/<image> (the ImageNet layout)", EXAMPLE)
    for split in SPLITS:
        if not (root / split).is_dir():
            with os.scandir(root) as entries:
                there = sorted(e.name + ("/" if e.is_dir() else "") for e in entries if not e.name.startswith("."))
            held = f"it holds {_listing(there)}" if there else "it is empty"
            hint = " (torchvision's ImageNet val/ comes flat: sort it into val/<class>/ folders first)" \
                if split == "val" else ""
            raise ConfigError(key, root, f"has no {split}/ folder ({held}); recipe=imagefolder needs train/<class>/"
                              f"<image> and val/<class>/<image>{hint}", EXAMPLE)
    folders: dict[str, Folder] = {}
    for split in SPLITS:
        classes = _class_folders(root / split)
        if not classes:
            with os.scandir(root / split) as entries:
                loose = any(e.is_file() and _is_image(e.name) for e in entries)
            what = "holds images but no class folders: put each class's images in" if loose else \
                "holds no class folders: put each class's images in"
            raise ConfigError(key, root, f"{split}/ {what} {split}/<class>/", EXAMPLE)
        try:
            walk = _SplitWalk(root / split)
            per_class = walk.run([(i, str(root / split / name)) for i, name in enumerate(classes)])
        except OSError as exc:  # (os.walk passed over a folder it could not list: its images went missing)
            raise ConfigError(key, root, f"cannot list {exc.filename or split} ({exc.strerror or exc}): make it "
                              "readable, or move it out of data.root", EXAMPLE) from None
        samples: list[tuple[str, int]] = []
        for index, (name, files) in enumerate(zip(classes, per_class, strict=True)):
            if not files and index in walk.roots_left:
                raise ConfigError(key, root, f"{split}/{name}/ is {walk.roots_left[index]} again (a link; each "
                                  "class needs a folder of its own): remove the link, or make it a folder of that "
                                  "class's images", EXAMPLE)
            if not files:
                raise ConfigError(key, root, f"{split}/{name}/ holds no images (files ending "
                                  f"{' '.join(IMAGE_SUFFIXES)}, any case): add some or remove the folder", EXAMPLE)
            samples.extend((f, index) for f in files)
        folders[split] = Folder(classes, samples, walk.left_out)
    train, val = folders["train"].classes, folders["val"].classes
    if train != val:
        only_train = sorted(set(train) - set(val))
        only_val = sorted(set(val) - set(train))
        parts = ([f"only in train/: {_listing(only_train)}"] if only_train else []) + \
            ([f"only in val/: {_listing(only_val)}"] if only_val else [])
        raise ConfigError(key, root, "train/ and val/ must hold the same class folders (a class's index is its "
                          f"place in their sorted names); {'; '.join(parts)}", EXAMPLE)
    return folders


def left_out_line(root: Path, folders: dict[str, Folder]) -> str | None:
    """One line saying which linked paths the scan of both splits left out (counts and an example of each
    kind), or None where it followed every link."""
    loops = [p for f in folders.values() for p in f.left_out.loops]
    again = [pair for f in folders.values() for pair in f.left_out.again]
    if not loops and not again:
        return None
    parts = ([f"{len(loops)} loop{'s' if len(loops) != 1 else ''} (a link to the folder it is in or one above "
              f"it, e.g. {loops[0]})"] if loops else []) + \
        ([f"{len(again)} second path{'s' if len(again) != 1 else ''} to a folder or image read already (e.g. "
          f"{again[0][0]}, which is {again[0][1]})"] if again else [])
    return (f"data.root={root}: left out {len(loops) + len(again)} linked paths, so that each image is one sample: "
            f"{'; '.join(parts)}")


# ---- drawing crops ------------------------------------------------------------------------------------------


def _mix(*values: int) -> int:
    """A 64-bit hash of integers (splitmix64 steps), to seed a sample's own random draws."""
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = (h ^ (v & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        h = (h ^ (h >> 31)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 29
    return h


def random_resized_crop_box(rng: random.Random, width: int, height: int, scale: tuple[float, float],
                            ratio: tuple[float, float] = (3 / 4, 4 / 3)) -> tuple[int, int, int, int]:
    """torchvision's RandomResizedCrop.get_params (same algorithm: 10 tries, then the central crop of the
    nearest aspect ratio), drawn from `rng`. Returns (left, top, width, height) in pixels."""
    area = width * height
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target_area = area * rng.uniform(scale[0], scale[1])
        aspect = math.exp(rng.uniform(*log_ratio))
        w = int(round(math.sqrt(target_area * aspect)))
        h = int(round(math.sqrt(target_area / aspect)))
        if 0 < w <= width and 0 < h <= height:
            return rng.randint(0, width - w), rng.randint(0, height - h), w, h
    in_ratio = width / height
    if in_ratio < min(ratio):
        w, h = width, int(round(width / min(ratio)))
    elif in_ratio > max(ratio):
        h, w = height, int(round(height * max(ratio)))
    else:
        w, h = width, height
    return (width - w) // 2, (height - h) // 2, w, h


def eval_geometry(width: int, height: int, resize: int, size: int) -> tuple[int, int, int, int]:
    """torchvision's Resize(resize) then CenterCrop(size): the resized (width, height) and the crop's
    (left, top) in the resized image."""
    if width <= height:
        new_w, new_h = resize, int(resize * height / width)
    else:
        new_w, new_h = int(resize * width / height), resize
    return new_w, new_h, int(round((new_w - size) / 2.0)), int(round((new_h - size) / 2.0))


# ---- decoding on the CPU -----------------------------------------------------------------------------------

GREY_BACKGROUND = tuple(int(round(m)) for m in MEAN)  # transparent pixels become the mean: 0 once normalized


def to_rgb(img: Image.Image) -> Image.Image:
    """Any PIL mode as 8-bit RGB: 16-bit grey scaled (not clipped) to 8 bits, transparency composited over
    the dataset's mean colour (what normalizes to 0), CMYK, palette and the rest converted by PIL."""
    mode = img.mode
    if mode == "RGB":
        return img
    if mode.startswith("I"):  # I, I;16, I;16B...: PNG's 16-bit grey (PIL's convert would clip at 255)
        a = np.asarray(img).astype(np.int64)
        a = np.clip(a >> 8 if a.max(initial=0) > 255 else a, 0, 255).astype(np.uint8)
        return Image.fromarray(a, "L").convert("RGB")
    if mode == "F":
        return Image.fromarray(np.clip(np.asarray(img), 0, 255).astype(np.uint8), "L").convert("RGB")
    if mode == "P" and "transparency" in img.info or mode in ("RGBA", "LA", "PA", "RGBa", "La"):
        rgba = img.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (*GREY_BACKGROUND, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return img.convert("RGB")


def _draft(img: Image.Image, need_w: float, need_h: float) -> float:
    """Let a JPEG decode at 1/2, 1/4 or 1/8 of its size when the result still holds `need_w` x `need_h`
    pixels of the original's extent (DCT scaling: far less work). Returns the scale applied (1: none)."""
    if img.format != "JPEG":
        return 1.0
    width = img.size[0]
    img.draft("RGB", (max(1, math.ceil(need_w)), max(1, math.ceil(need_h))))
    return img.size[0] / width


def decode_train_crop(img: Image.Image, box: tuple[int, int, int, int], size: int, flip: bool,
                      draft: bool = True) -> torch.Tensor:
    """The crop `box` (left, top, width, height, in the original's pixels) of `img`, resized to size x size
    (bilinear, antialiased), flipped if asked: uint8 CHW. Where `draft` lets the JPEG decode smaller, the
    box's edges are rounded to the smaller image's pixels."""
    left, top, w, h = box
    width, height = img.size
    if draft:
        _draft(img, width * size / w, height * size / h)
    pixels = _hwc(to_rgb(img))
    sx, sy = pixels.shape[1] / width, pixels.shape[0] / height
    x0, y0 = round(left * sx), round(top * sy)
    x1, y1 = max(x0 + 1, round((left + w) * sx)), max(y0 + 1, round((top + h) * sy))
    out = _resize(pixels[y0:y1, x0:x1], size, size)
    return out.flip(-1) if flip else out


def decode_eval_crop(img: Image.Image, resize: int, size: int, draft: bool = True) -> torch.Tensor:
    """Resize(resize) + CenterCrop(size), as torchvision does them: uint8 CHW."""
    width, height = img.size
    new_w, new_h, left, top = eval_geometry(width, height, resize, size)
    if draft:
        _draft(img, new_w, new_h)
    resized = _resize(_hwc(to_rgb(img)), new_h, new_w)
    return resized[:, top:top + size, left:left + size].contiguous()


def decode_region(img: Image.Image, box: tuple[float, float, float, float], size: int,
                  draft: bool = True) -> tuple[torch.Tensor, tuple[float, float, float, float]]:
    """The pixels under `box` (x0, y0, x1, y1, pixel edges of the original), decoded but not resized: uint8
    HWC, the whole pixels around the box (at the reduced size `draft` allows, as decode_train_crop has it),
    and the box in them. The GPU resizes it (image_kernels), which spares the worker about a third of a
    sample's work (the resize: 0.6 of 1.8 ms on a Xeon core, bench/probe/cpu_decode.py)."""
    width, height = img.size
    x0, y0, x1, y1 = box
    if draft:
        _draft(img, width * size / max(x1 - x0, 1e-6), height * size / max(y1 - y0, 1e-6))
    rgb = to_rgb(img)
    sx, sy = rgb.size[0] / width, rgb.size[1] / height
    left, top = min(math.floor(x0 * sx), rgb.size[0] - 1), min(math.floor(y0 * sy), rgb.size[1] - 1)
    right = min(rgb.size[0], max(left + 1, math.ceil(x1 * sx)))
    bottom = min(rgb.size[1], max(top + 1, math.ceil(y1 * sy)))
    pixels = torch.from_numpy(np.array(rgb.crop((left, top, right, bottom))))
    return pixels, (x0 * sx - left, y0 * sy - top, x1 * sx - left, y1 * sy - top)


def _hwc(img: Image.Image) -> torch.Tensor:
    """An RGB image's pixels, uint8 HWC (a writable copy out of PIL: as fast as a read-only view, which torch
    warns about, and nothing global to silence that warning from the threads that decode)."""
    return torch.from_numpy(np.array(img))


def _resize(hwc: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """uint8 HWC pixels resized to height x width, bilinear and antialiased (PIL's filter, in torch's
    vectorized uint8 kernel: about 2x faster than PIL's own on one core): uint8 CHW, contiguous."""
    chw = hwc.permute(2, 0, 1).unsqueeze(0)  # (a channels-last view: what that kernel reads fastest)
    if chw.shape[-2:] == (height, width):
        return chw[0].contiguous()
    return torch.nn.functional.interpolate(chw, size=(height, width), mode="bilinear", antialias=True,
                                           align_corners=False)[0].contiguous()


# ---- what a worker hands over for the GPU ------------------------------------------------------------------


@dataclass
class Encoded:
    """A JPEG for the GPU: its bytes (uint8, 1-D), the crop box (x0, y0, x1, y1, in the original's pixels,
    edges), whether to flip, and its path (for an error that names it)."""

    data: torch.Tensor
    box: tuple[float, float, float, float]
    flip: bool
    path: str


@dataclass
class Region:
    """A crop decoded by a worker for the GPU to resize (data.decode=gpu/auto where image_kernels runs): the
    pixels around the box (uint8 HWC), the box in them (x0, y0, x1, y1, pixel edges), whether to flip."""

    pixels: torch.Tensor
    box: tuple[float, float, float, float]
    flip: bool
    slots: PinnedSlots | None = None  # (the split's, where its batches go: see collate)


class Regions:
    """A batch's Regions, described for the GPU: each one's first byte in the batch's pixel buffer, (height,
    width), box, flip and batch row (host tensors; kept off the device like HostJpegs). `slot`: where the
    buffer is one of the split's PinnedSlots (its index; the batch's pixels are then empty), else -1."""

    def __init__(self, offsets: torch.Tensor, shapes: torch.Tensor, boxes: torch.Tensor, flips: torch.Tensor,
                 rows: torch.Tensor, slot: int = -1, nbytes: int = 0):
        self.offsets, self.shapes, self.boxes, self.flips, self.rows = offsets, shapes, boxes, flips, rows
        self.slot, self.nbytes = slot, nbytes

    def __len__(self) -> int:
        return len(self.rows)


class GpuWork:
    """What a mixed batch leaves to the GPU (see `collate`): its JPEGs to decode, and where its workers'
    crops are not resized yet, their Regions (None: they are size x size already). Neither a tensor nor a
    container, so the DataLoader's pinning and the launcher's copy to the device leave it on the host."""

    def __init__(self, jpegs: HostJpegs, regions: Regions | None):
        self.jpegs, self.regions = jpegs, regions


class HostJpegs:
    """A batch's JPEGs, kept on the host: nvJPEG reads its input from host memory
    (torchvision.io.decode_jpeg takes CPU tensors whatever its device). Deliberately not a tensor, a
    sequence or a mapping, so the DataLoader's pinning and the launcher's copy to the device leave it as
    it is. `rows`: the batch rows they fill."""

    def __init__(self, data: torch.Tensor, offsets: list[int], boxes: torch.Tensor, flips: torch.Tensor,
                 rows: torch.Tensor, paths: list[str]):
        self.data, self.offsets, self.paths = data, offsets, paths
        self.boxes, self.flips, self.rows = boxes, flips, rows

    def __len__(self) -> int:
        return len(self.paths)

    def tensors(self) -> list[torch.Tensor]:
        return [self.data[a:b] for a, b in zip(self.offsets[:-1], self.offsets[1:], strict=True)]


# ---- the datasets -----------------------------------------------------------------------------------------


class ImageFolderSplit(torch.utils.data.Dataset):
    """One split of the folder. A sample is `(image, label)`: image a uint8 CHW crop (decode cpu), or for
    the GPU an `Encoded` JPEG (decode gpu/auto, where the file suits nvJPEG); None when the file is bad and
    on_bad_file is skip. `classes`, `samples` and `targets` as torchvision's ImageFolder has them."""

    def __init__(self, folder: Folder, *, train: bool, image_size: int, eval_resize: int, min_scale: float = 0.08,
                 seed: int = 0, gpu_share: float = 0.0, skip_bad: bool = False, draft: bool = True,
                 regions: bool = False):
        self.classes = list(folder.classes)
        self.class_to_idx = {c: i for i, c in enumerate(self.classes)}
        # Paths as one fixed-width byte array (relative to their common folder) and labels as one int array:
        # a worker gets them as two buffers (1.3M ImageNet paths: ~40 MB, pickled in a blink) instead of a
        # list of 1.3M tuples, which every worker would copy and whose refcounts a forked worker would write.
        paths = [p for p, _ in folder.samples]
        self._dir = os.path.commonpath([paths[0], paths[-1]]) if paths else ""  # (sorted: shared by all between)
        if len(paths) == 1 or any(not p.startswith(self._dir + os.sep) for p in paths[:: max(1, len(paths) // 64)]):
            self._dir = os.path.commonpath([os.path.dirname(p) for p in paths]) if paths else ""
        start = len(self._dir) + 1 if self._dir else 0
        self._paths = np.array([p[start:].encode("utf-8", "surrogateescape") for p in paths], dtype=np.bytes_)
        self._labels = np.array([label for _, label in folder.samples], dtype=np.int64)
        self.train, self.image_size, self.eval_resize, self.min_scale = train, image_size, eval_resize, min_scale
        self.seed, self.skip_bad, self.draft = seed, skip_bad, draft
        self.regions = regions  # the workers' crops handed over unresized (Region), for the GPU to resize
        self.slots: PinnedSlots | None = None  # where its workers' batches of Regions go (ImageFolder.load)
        # The share of samples meant for the GPU decoder (read sample by sample; see share_with_workers).
        self._gpu_share = torch.full((1,), float(gpu_share), dtype=torch.float64)
        # Per DataLoader worker (row = worker id; the last row: no worker), the samples it made and the seconds
        # it spent making them: data.decode=auto's measure of what the workers can make (share_with_workers)
        self._work: torch.Tensor | None = None
        self._work_view: np.ndarray | None = None  # (this process's numpy view of it: cheap to add to)
        self._epoch = -1  # this process's (set_epoch)
        self._visits: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._labels)

    def path(self, index: int) -> str:
        return os.path.join(self._dir, self._paths[index].decode("utf-8", "surrogateescape"))

    @property
    def samples(self) -> list[tuple[str, int]]:
        """(path, class index) per sample, in torchvision ImageFolder's order (built when asked)."""
        return [(self.path(i), int(label)) for i, label in enumerate(self._labels)]

    @property
    def targets(self) -> list[int]:
        return self._labels.tolist()

    @property
    def gpu_share(self) -> float:
        return float(self._gpu_share[0])

    @gpu_share.setter
    def gpu_share(self, share: float) -> None:
        self._gpu_share[0] = float(share)

    def share_with_workers(self) -> None:
        """Keep the share in shared memory, so that DataLoader workers forked after this follow a change made
        here while they run, and have them count their work where this process reads it (`work`;
        data.decode=auto's DecodeTrial; a run that does neither needs no shared memory for it)."""
        self._gpu_share.share_memory_()
        self._work = torch.zeros((WORK_SLOTS, 2), dtype=torch.float64).share_memory_()

    def work(self) -> torch.Tensor | None:
        """(samples made, seconds spent making them) per DataLoader worker so far; None unless shared."""
        return None if self._work is None else self._work.clone()

    def set_epoch(self, epoch: int) -> None:
        """The epoch the samples this process reads next belong to (the launcher tells each worker)."""
        self._epoch = int(epoch)

    def _rng(self, index: int) -> random.Random:
        """The sample's own random draws, from (seed, epoch, index)."""
        epoch = self._epoch
        if epoch < 0:  # set_epoch not called: the DataLoader's base seed, new each epoch
            info = torch.utils.data.get_worker_info()
            if info is not None:
                epoch = (info.seed - info.id) + (1 << 40)
            else:  # no worker processes: this process's visits of the sample
                epoch = self._visits.get(index, 0) + (1 << 41)
                self._visits[index] = epoch - (1 << 41) + 1
        return random.Random(_mix(self.seed, epoch, index))

    def _on_gpu(self, index: int) -> bool:
        """Whether the sample is meant for the GPU decoder (under auto, the samples whose index hashes below
        the share: the same ones for the same share)."""
        share = self.gpu_share
        if share <= 0.0 or share >= 1.0:
            return share >= 1.0
        return _mix(0x5EED, index) % 10_000 < share * 10_000

    def __getitem__(self, index: int) -> Any:
        if self._work is None:
            return self._sample(index)
        began = time.perf_counter()
        try:
            return self._sample(index)
        finally:
            info = torch.utils.data.get_worker_info()
            if self._work_view is None:
                self._work_view = self._work.numpy()
            row = self._work_view[info.id if info is not None and info.id < WORK_SLOTS - 1 else WORK_SLOTS - 1]
            row += (1.0, time.perf_counter() - began)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_work_view": None}  # (a view would be pickled as a copy: made again there)

    def _sample(self, index: int) -> Any:
        path, label = self.path(index), int(self._labels[index])
        rng = self._rng(index) if self.train else None
        try:
            if self._on_gpu(index):
                encoded = self._encoded(path, rng)
                if encoded is not None:
                    return encoded, label
            if self.regions:
                return self._region(path, rng), label
            return self._decoded(path, rng), label
        except BadImageError:
            raise
        except Exception as exc:  # noqa: BLE001 - any failure to read or decode the file is the file's
            if self.skip_bad:
                said_skipped(path, exc)
                return None
            raise bad_file(path, exc) from None

    def _decoded(self, path: str, rng: random.Random | None) -> torch.Tensor:
        with Image.open(path) as img:
            if rng is not None:
                box = random_resized_crop_box(rng, *img.size, (self.min_scale, 1.0))
                flip = rng.random() < 0.5
                return decode_train_crop(img, box, self.image_size, flip, self.draft)
            return decode_eval_crop(img, self.eval_resize, self.image_size, self.draft)

    def _box(self, rng: random.Random | None, width: int, height: int) -> tuple[tuple[float, float, float, float],
                                                                             bool]:
        """The crop box (x0, y0, x1, y1, pixel edges of the original) and whether to flip it: training's
        random draws (the CPU path's, in its order), or evaluation's resize-and-center-crop as a box."""
        if rng is not None:
            left, top, w, h = random_resized_crop_box(rng, width, height, (self.min_scale, 1.0))
            flip = rng.random() < 0.5
            return (float(left), float(top), float(left + w), float(top + h)), flip
        new_w, new_h, left, top = eval_geometry(width, height, self.eval_resize, self.image_size)
        sx, sy = width / new_w, height / new_h
        return (left * sx, top * sy, (left + self.image_size) * sx, (top + self.image_size) * sy), False

    def _region(self, path: str, rng: random.Random | None) -> Region:
        with Image.open(path) as img:
            box, flip = self._box(rng, *img.size)
            pixels, inside = decode_region(img, box, self.image_size, self.draft)
        return Region(pixels, inside, flip, self.slots)

    def _encoded(self, path: str, rng: random.Random | None) -> Encoded | None:
        """The file's bytes and crop box for nvJPEG, or None when the file is for the CPU decoder. The
        random draws are the same as the CPU path's (the same box from the same header size)."""
        with open(path, "rb") as f:
            data = f.read()
        with Image.open(io.BytesIO(data)) as img:  # the header only
            fmt, mode, (width, height) = img.format, img.mode, img.size
            progressive = bool(img.info.get("progressive") or img.info.get("progression"))
        if fmt != "JPEG" or mode != "RGB" or progressive or not data.rstrip(b"\0").endswith(b"\xff\xd9"):
            return None  # (a JPEG without its end marker is likely truncated: the CPU decoder names it)
        box, flip = self._box(rng, width, height)
        return Encoded(torch.frombuffer(bytearray(data), dtype=torch.uint8), box, flip, path)


# ---- batches ----------------------------------------------------------------------------------------------


def _batch_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An empty tensor for a collated batch: in a DataLoader worker, in shared memory from the start (as
    torch's default_collate makes it), so handing the batch over copies nothing more."""
    if torch.utils.data.get_worker_info() is None:
        return torch.empty(shape, dtype=dtype)
    numel = math.prod(shape)
    storage = torch.UntypedStorage._new_shared(numel * dtype.itemsize)
    return torch.empty(0, dtype=dtype).set_(storage, 0, shape, torch.empty(shape, device="meta").stride())


def collate(samples: list[tuple[Any, int]]) -> tuple[Any, ...]:
    """(images uint8 NCHW, labels int64) when every sample was decoded and resized by a worker; else a mixed
    batch (pixels, labels (N,), rows (m,), GpuWork), the GPU finishing it: the m samples the workers decoded
    are `pixels`, uint8 (m, C, S, S) crops, or their Regions (not resized yet) one after another in one uint8
    buffer; GpuWork carries the JPEGs left to decode and the Regions' table."""
    labels = torch.tensor([label for _, label in samples], dtype=torch.int64)
    decoded = [(row, img) for row, (img, _) in enumerate(samples) if isinstance(img, torch.Tensor)]
    if len(decoded) == len(samples):
        return torch.stack([img for _, img in decoded], out=_batch_tensor((len(decoded), *decoded[0][1].shape),
                                                                          torch.uint8)), labels
    jpegs = [(row, s) for row, (s, _) in enumerate(samples) if isinstance(s, Encoded)]
    offsets = [0]
    for _, e in jpegs:
        offsets.append(offsets[-1] + e.data.numel())
    host = HostJpegs(torch.cat([e.data for _, e in jpegs]) if jpegs else torch.empty(0, dtype=torch.uint8), offsets,
                     torch.tensor([e.box for _, e in jpegs], dtype=torch.float32).view(-1, 4),
                     torch.tensor([e.flip for _, e in jpegs], dtype=torch.bool),
                     torch.tensor([row for row, _ in jpegs], dtype=torch.int64), [e.path for _, e in jpegs])
    regions = [(row, s) for row, (s, _) in enumerate(samples) if isinstance(s, Region)]
    if regions:
        sizes = [r.pixels.numel() for _, r in regions]
        starts = torch.tensor([0, *sizes], dtype=torch.int64).cumsum(0)
        total, slots = sum(sizes), regions[0][1].slots
        slot = slots.claim(total) if slots is not None else None
        flat = [r.pixels.reshape(-1) for _, r in regions]
        if slot is not None:  # (written where the training process copies it to the GPU from: launcher/data/slots.py)
            torch.cat(flat, out=slots.view(slot, total))
            pixels = torch.empty(0, dtype=torch.uint8)
        else:
            pixels = torch.cat(flat, out=_batch_tensor((total,), torch.uint8))
        rows = torch.tensor([row for row, _ in regions], dtype=torch.int64)
        table = Regions(starts[:-1], torch.tensor([r.pixels.shape[:2] for _, r in regions], dtype=torch.int64),
                        torch.tensor([r.box for _, r in regions], dtype=torch.float32),
                        torch.tensor([r.flip for _, r in regions], dtype=torch.bool), rows.clone(),
                        -1 if slot is None else slot, total)
        return pixels, labels, rows, GpuWork(host, table)
    if decoded:
        pixels = torch.stack([img for _, img in decoded])
    else:
        side = 0  # (no decoded crop in this batch: an empty block)
        pixels = torch.empty((0, 3, side, side), dtype=torch.uint8)
    return pixels, labels, torch.tensor([row for row, _ in decoded], dtype=torch.int64), GpuWork(host, None)


class HardwareDecoder:
    """nvImageCodec's batched JPEG decoder (the `nvidia-nvimgcodec-cu12`/`-cu13` package, with its nvjpeg
    extra), on the GPU's hardware JPEG engines where it has them (A100, H100, H200: NVJPG, beside the SMs,
    so decoding takes nothing from training), else on its CUDA decoder. A batch is split between PARTS
    decoders, each called from its own thread (the call returns once its images are decoded, with the GIL
    released meanwhile): on an H100 one decoder took a batch of 256 at 13,400 img/s, two at 21,200, four at
    15,800 (bench/probe/imagefolder_contention.py). The images are ready on the current stream; their
    memory belongs to nvImageCodec, so each batch's images (and its bytes) are kept until an event after
    their last use (`release_after`) has passed."""

    PARTS = 2
    MIN_PART = 16  # (a smaller batch is decoded in one call)

    def __init__(self, device: torch.device):
        from concurrent.futures import ThreadPoolExecutor

        from nvidia import nvimgcodec

        self.nv = nvimgcodec
        self.device = device
        index = device.index if device.index is not None else torch.cuda.current_device()
        self.decoders = [nvimgcodec.Decoder(device_id=index,
                                            backends=[nvimgcodec.Backend(nvimgcodec.BackendKind.HW_GPU_ONLY),
                                                      nvimgcodec.Backend(nvimgcodec.BackendKind.GPU_ONLY)])
                         for _ in range(self.PARTS)]
        self.params = nvimgcodec.DecodeParams(apply_exif_orientation=False, color_spec=nvimgcodec.ColorSpec.SRGB,
                                              sample_format=nvimgcodec.SampleFormat.I_RGB)
        self._streams = [torch.cuda.Stream(device) for _ in range(self.PARTS - 1)]
        self._pool = ThreadPoolExecutor(self.PARTS - 1, thread_name_prefix="launch-decode",
                                        initializer=torch.cuda.set_device, initargs=(index,))
        self._held: deque[tuple[torch.cuda.Event, list[Any]]] = deque()
        self._pending: list[Any] = []

    def _decode(self, part: int, sources: list[Any], stream: torch.cuda.Stream) -> list[Any]:
        return list(self.decoders[part].decode(sources, params=self.params, cuda_stream=stream.cuda_stream))

    def __call__(self, jpegs: HostJpegs) -> list[Any]:
        """The batch's JPEGs decoded: nvImageCodec's images (HWC, on the device; None where one could not be)."""
        while self._held and self._held[0][0].query():
            self._held.popleft()
        data = jpegs.data.numpy()
        sources = [self.nv.CodeStream(data[a:b]) for a, b in zip(jpegs.offsets[:-1], jpegs.offsets[1:], strict=True)]
        current = torch.cuda.current_stream(self.device)
        parts = min(self.PARTS, max(1, len(sources) // self.MIN_PART))
        cuts = [len(sources) * k // parts for k in range(parts + 1)]
        others = [self._pool.submit(self._decode, k, sources[cuts[k]:cuts[k + 1]], self._streams[k - 1])
                  for k in range(1, parts)]
        images = self._decode(0, sources[:cuts[1]], current)
        for k, other in enumerate(others, start=1):
            images += other.result()
            done = torch.cuda.Event()
            done.record(self._streams[k - 1])
            current.wait_event(done)
        self._pending = [data, sources, images]
        return images

    def release_after(self) -> None:
        """The last use of the images decoded last is queued on the current stream: free them once it ran."""
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self.device))
        self._held.append((done, self._pending))
        self._pending = []


_hardware: dict[torch.device, HardwareDecoder | None] = {}


def hardware_decoder(device: torch.device) -> HardwareDecoder | None:
    """nvImageCodec's decoder for `device` where the package is installed and works there, else None
    (torchvision's nvJPEG decodes); made once per device."""
    if device not in _hardware:
        try:
            _hardware[device] = HardwareDecoder(device) if device.type == "cuda" else None
        except ImportError:  # (not installed: torchvision's nvJPEG, as the decode plan says)
            _hardware[device] = None
        except Exception as exc:  # noqa: BLE001 - installed but not working here: said, then torchvision's
            log.warning("nvImageCodec is installed but its decoder does not start on %s (%s: %s): torchvision's "
                        "nvJPEG decodes instead", device, type(exc).__name__, exc)
            _hardware[device] = None
    return _hardware[device]


def decode_jpegs(jpegs: HostJpegs, device: torch.device, skip_bad: bool) -> tuple[list[Any], list[int]]:
    """The batch's JPEGs decoded on `device` (one batched call: nvImageCodec's hardware decoder where
    installed, else torchvision's nvJPEG): uint8 RGB images, nvImageCodec's (HWC) or tensors (CHW); and the
    indices of the ones that could not be (only when skip_bad; else a BadImageError names the first)."""
    from torchvision.io import ImageReadMode, decode_jpeg

    tensors = jpegs.tensors()
    hardware = hardware_decoder(device)
    if hardware is not None:
        images, bad = hardware(jpegs), []
        for i, img in enumerate(images):
            if img is None:  # not decodable there: nvJPEG says why, or decodes it
                try:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        images[i] = decode_jpeg(tensors[i], mode=ImageReadMode.RGB, device=device)
                except RuntimeError as exc:
                    if not skip_bad:
                        raise bad_file(jpegs.paths[i], exc) from None
                    said_skipped(jpegs.paths[i], exc)
                    bad.append(i)
        return [img for img in images if img is not None], bad
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (torchvision 0.29 deprecates its decoders in favour of TorchCodec)
        try:
            return list(decode_jpeg(tensors, mode=ImageReadMode.RGB, device=device)), []
        except RuntimeError:  # one bad file fails the batched call: find it
            images, bad = [], []
            for i, t in enumerate(tensors):
                try:
                    images.append(decode_jpeg(t, mode=ImageReadMode.RGB, device=device))
                except RuntimeError as exc:
                    if not skip_bad:
                        raise bad_file(jpegs.paths[i], exc) from None
                    said_skipped(jpegs.paths[i], exc)
                    bad.append(i)
            return images, bad


def as_chw(image: Any, device: torch.device) -> torch.Tensor:
    """A decoded image as a uint8 CHW tensor (a view of nvImageCodec's HWC buffer, or the tensor itself)."""
    if isinstance(image, torch.Tensor):
        return image
    return torch.as_tensor(image, device=device).permute(2, 0, 1)


def crop_resize(images: list[torch.Tensor], boxes: torch.Tensor, size: int,
                max_elements: int = 1 << 26) -> torch.Tensor:
    """Each image's box (x0, y0, x1, y1, pixel edges) resized to size x size, for the whole batch in a few
    roi_align calls: the images are stacked one under the other on a canvas (as wide as the widest), in
    chunks of at most `max_elements` canvas values. roi_align's adaptive sampling averages ceil(box/size)^2
    bilinear samples per output pixel: an antialiased downscale. Returns float (N, C, size, size), 0..255."""
    from torchvision.ops import roi_align

    device = images[0].device
    dtype = torch.float32  # (not float16: the boxes' rows on a canvas of thousands of rows would round by pixels)
    out = torch.empty((len(images), 3, size, size), dtype=torch.float32, device=device)
    boxes = boxes.to(device=device, dtype=torch.float32)
    start = 0
    while start < len(images):  # each image's slot: a copy of its first row, the image, a copy of its last row,
        end, rows, width = start, 0, 0  # and a copy of its last column (roi_align reads up to half a pixel past
        while end < len(images):  # a box's edge: there it must see the image's own edge, as a lone image's would)
            h, w = images[end].shape[-2:]
            if end > start and (rows + h + 2) * max(width, w + 1) * 3 > max_elements:
                break
            rows, width, end = rows + h + 2, max(width, w + 1), end + 1
        canvas = torch.zeros((1, 3, rows, width), dtype=dtype, device=device)
        tops, y = [], 0
        for img in images[start:end]:
            tops.append(y + 1)  # (the image's first row, below its copy)
            y += img.shape[-2] + 2
        dst, src = [], []
        for t, img in zip(tops, images[start:end], strict=True):
            h, w = img.shape[-2:]
            slot = canvas[0, :, t - 1:t + h + 1, :w + 1]
            dst += [slot[:, 1:h + 1, :w], slot[:, 0, :w], slot[:, h + 1, :w], slot[:, 1:h + 1, w], slot[:, 0, w],
                    slot[:, h + 1, w]]
            src += [img, img[:, 0], img[:, h - 1], img[:, :, w - 1], img[:, 0, w - 1], img[:, h - 1, w - 1]]
        torch._foreach_copy_(dst, src)
        shift = torch.tensor(tops, dtype=torch.float32, device=device)
        chunk = boxes[start:end].clone()
        chunk[:, 1] += shift
        chunk[:, 3] += shift
        rois = torch.cat([torch.zeros((end - start, 1), dtype=torch.float32, device=device), chunk], dim=1)
        out[start:end] = roi_align(canvas, rois.to(dtype), (size, size), spatial_scale=1.0, sampling_ratio=0,
                                   aligned=True).float()
        start = end
    return out


class Normalizer:
    """uint8 or 0..255 float NCHW on the device -> float, ImageNet-normalized (channels_last if asked)."""

    def __init__(self, channels_last: bool):
        self.channels_last = channels_last
        self._cache: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.device not in self._cache:
            mean = torch.tensor(MEAN, device=x.device).view(1, 3, 1, 1)
            self._cache[x.device] = (mean, 1.0 / torch.tensor(STD, device=x.device).view(1, 3, 1, 1))
        mean, inv_std = self._cache[x.device]
        x = (x.float() - mean) * inv_std
        if self.channels_last and x.device.type == "cuda":
            x = x.contiguous(memory_format=torch.channels_last)
        return x


def resize_regions(pixels: torch.Tensor, regions: Regions, out: torch.Tensor, normalize: Normalizer) -> None:
    """The workers' Regions (in `pixels`, on out's device) resized, flipped and normalized into their rows of
    `out`: one kernel (image_kernels) where it runs, else crop_resize and torch ops on views of the buffer."""
    from launcher.data import image_kernels

    if not len(regions):
        return
    if image_kernels.usable(out.device):
        image_kernels.crop_resize_normalize_flat(pixels, regions.offsets, regions.shapes, regions.boxes,
                                                 regions.flips, regions.rows, out, MEAN, STD)
        return
    views = [pixels[o:o + h * w * 3].view(h, w, 3).permute(2, 0, 1)
             for o, (h, w) in zip(regions.offsets.tolist(), regions.shapes.tolist(), strict=True)]
    crops = crop_resize(views, regions.boxes, out.shape[-1])
    crops = torch.where(regions.flips.to(out.device).view(-1, 1, 1, 1), crops.flip(-1), crops)
    out[regions.rows.to(out.device)] = normalize(crops)


def gpu_batch(batch: tuple[Any, ...], size: int, skip_bad: bool, normalize: Normalizer,
              slots: PinnedSlots | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A mixed batch (see `collate`) as one normalized float NCHW batch on the labels' device, and its labels.
    The decoded JPEGs are cropped, resized, flipped and normalized by one kernel (image_kernels) where it
    runs, else by `crop_resize` and torch ops."""
    from launcher.data import image_kernels

    pixels, labels, pixel_rows, work = batch
    jpegs = work.jpegs
    device = labels.device
    out = torch.empty((len(labels), 3, size, size), dtype=torch.float32, device=device)
    if normalize.channels_last and device.type == "cuda":
        out = out.contiguous(memory_format=torch.channels_last)
    keep = None
    if work.regions is not None:
        if work.regions.slot >= 0:
            pixels = slots.to_device(work.regions.slot, work.regions.nbytes, device)
        resize_regions(pixels.to(device), work.regions, out, normalize)
    elif len(pixel_rows):
        out[pixel_rows.to(device)] = normalize(pixels.to(device))
    if not len(jpegs):
        return out, labels
    images, bad = decode_jpegs(jpegs, device, skip_bad)
    rows, boxes, flips = jpegs.rows, jpegs.boxes, jpegs.flips
    if bad:
        good = [i for i in range(len(jpegs)) if i not in set(bad)]
        log.warning("left out %d JPEG(s) nvJPEG could not decode (data.on_bad_file=skip): %s", len(bad),
                    ", ".join(jpegs.paths[i] for i in bad))
        keep = torch.ones(len(labels), dtype=torch.bool)
        keep[rows[bad]] = False
        rows, boxes, flips = rows[good], boxes[good], flips[good]
    if images:
        if image_kernels.usable(device):
            image_kernels.crop_resize_normalize(images, boxes, flips, rows, out, MEAN, STD)
        else:
            crops = crop_resize([as_chw(img, device) for img in images], boxes, size)
            crops = torch.where(flips.to(device).view(-1, 1, 1, 1), crops.flip(-1), crops)
            out[rows.to(device)] = normalize(crops)
    hardware = hardware_decoder(device)
    if hardware is not None:
        hardware.release_after()
    if keep is not None:
        keep = keep.to(device)
        return out[keep], labels[keep]
    return out, labels


# ---- the recipe -------------------------------------------------------------------------------------------


class DecodeTrial:
    """data.decode=auto on CUDA: which way of decoding trains faster, measured on the run's own first
    training batches. The workers alone go first. Where they keep up with the steps, they are kept and
    nothing else is tried. Where they do not (they need longer to make a batch than a step takes, the steps
    fed meanwhile from the stock they made ahead), a split follows, sized from those two times: the share of
    each batch the workers make in a step's time (less MARGIN) stays with them, the rest goes to the GPU's
    decoder. Where that split's own times are still apart (its workers behind its steps, or idle beside
    them: the GPU's decoding changes the step; or its decoding holding the prefetch thread longer than a
    step), one more split balances them the same way. Each candidate (a share of each batch for the GPU
    decoder) is set in the Dataset (its workers read the share sample by sample) and timed over MEASURE
    training batches made under it, after its first SETTLE (the pipeline filling), by what each of the three
    that feed a step needs for a batch:

    - the steps: the median of the last MEASURE steps' own times on the GPU's clock (the launcher's
      StepPace: from the batch being ready to the step's end, input waits left out), the GPU's decoding
      beside them included. Not the gaps between batches reaching the prefetch thread: the host runs ahead
      of the GPU and catches up in bursts (on two H200s the gaps' median said 22.9 to 70.7 ms for 38 ms
      steps, and a split was tried where the workers kept up). The gaps' median stands in only where the
      loop gave no StepPace (the recipe driven by hand);
    - the workers: the time they need to make a batch, from what each one made and the seconds it spent
      making it (ImageFolderSplit.work: each of them working at once, as they do). Their stock of batches
      made ahead (up to their prefetch_factor each) hides for a while that they cannot keep up, so the
      steps alone would not tell (on one H200 host the steps said 37.8 ms for the workers alone where the
      epochs then took 48-59 ms a batch);
    - the prefetch thread: the median time on_after_batch_transfer held it (the GPU decoder returns once
      its images are decoded), the one thread every batch passes through.

    A batch takes the longest of the three. The fastest candidate is kept, said in one line; the workers
    alone win a tie within TIE (GPU decoding beside training also costs the step's host and GPU time).
    Which samples go to which decoder changes the pixels only by the two decoders' rounding: the crops,
    flips, order and resume are the same whatever is kept. (The split used to come from decoding rates
    measured apart, on other machines: 74% on the GPU for 15 workers, where the host's own workers needed
    about a quarter. BENCHMARKS.md.)"""

    MEASURE = 24
    SETTLE = 8  # a candidate's first batches, untimed (the warm-up's, the pipeline filling)
    TIE = 0.02
    GIVE_UP = 200  # batches without one made under the candidate's share (a folder of PNGs, say): skip it
    SPLITS = 2  # splits tried at most, after the workers alone
    MARGIN = 0.95  # of the share the workers' times say they can make in a step: room for their pace's swings
    LEAST = 0.05  # a smaller share for the GPU, or a smaller change of it, is not tried (within the noise)

    def __init__(self, splits: tuple[ImageFolderSplit, ImageFolderSplit], start_after: int = 0,
                 pace: Callable[[int], float | None] | None = None):
        self.splits = splits
        self.start_after = start_after  # training batches before the trial (the workers alone meanwhile)
        self.pace = pace  # n -> the median own time of the last n steps (StepPace.median_s), None: not known
        self.candidates = [0.0]  # the GPU's shares tried, in this order (the workers alone first)
        self.index, self.waited, self.made, self.seen, self.samples = 0, 0, 0, 0, 0
        self.stamps: list[float] = []
        self.held: list[float] = []  # the prefetch thread's seconds for each timed batch
        self.work_from: torch.Tensor | None = None
        # (a batch, the steps, the workers, the prefetch thread), seconds; None: no batch made under that share
        self.results: list[tuple[float, float, float, float] | None] = []
        self.done = False
        for split in splits:
            split.share_with_workers()
            split.gpu_share = 0.0

    @staticmethod
    def said(share: float) -> str:
        return "the workers alone" if share == 0.0 else f"{round(100 * share)}% on the GPU"

    def batch(self, samples: int, gpu_samples: int, held_s: float = 0.0) -> None:
        """A training batch of `samples` went through the prefetch thread (one thread:
        launcher/data/prefetch.py), which on_after_batch_transfer held for `held_s`; `gpu_samples` of them
        were for the GPU decoder."""
        if self.done:
            return
        self.seen += 1
        if self.seen <= self.start_after:
            return
        share = self.candidates[self.index]
        if (gpu_samples > 0) != (share > 0):  # (still one of the last candidate's batches)
            self.waited += 1
            if self.waited >= self.GIVE_UP:
                self._next(None)
            return
        self.made += 1
        if self.made <= self.SETTLE:
            return
        self.stamps.append(time.perf_counter())
        if len(self.stamps) == 1:
            self.work_from, self.samples, self.held = self.splits[0].work(), 0, []
            return
        self.samples += samples
        self.held.append(held_s)
        if len(self.stamps) > self.MEASURE:
            steps = self.pace(self.MEASURE) if self.pace is not None else None
            if steps is None:
                steps = statistics.median(b - a for a, b in zip(self.stamps[:-1], self.stamps[1:], strict=True))
            workers = self._workers_per_batch(self.samples / self.MEASURE)
            thread = statistics.median(self.held)
            self._next((max(steps, workers, thread), steps, workers, thread))

    def _workers_per_batch(self, samples: float) -> float:
        """Seconds the workers need for a batch of `samples`, at the rate each made its samples since timing
        began (all working at once); 0 where none made any."""
        work = self.splits[0].work()
        if work is None or self.work_from is None:
            return 0.0
        made, spent = (work - self.work_from).unbind(1)
        busy = (made > 0) & (spent > 0)
        rate = float((made[busy] / spent[busy]).sum())
        return samples / rate if rate > 0 else 0.0

    def following(self) -> float | None:
        """The GPU's share to try next, from the last candidate's times; None: none (the trial ends). The
        workers' time for a batch is taken as proportional to their share of it (the share they can make
        in a step's time is theirs now x steps / workers), and so is the prefetch thread's under a split
        (the GPU decoder's). Where no share keeps both within a step, the one where they take as long."""
        if len(self.candidates) > self.SPLITS or self.results[-1] is None:
            return None  # (None: no batch was made under that share, a folder the GPU decoder cannot take)
        share, (_, steps, workers, thread) = self.candidates[-1], self.results[-1]
        if share == 0.0:
            steps = max(steps, thread)  # (the thread's own work without decoding: a floor for any split)
            if workers <= steps * (1 + self.TIE):
                return None  # the workers alone keep up: nothing for the GPU to add
        if workers <= 0.0:
            return None
        gpu = min(1.0, max(0.0, 1.0 - (1.0 - share) * steps / workers * self.MARGIN))
        whole_decoder = thread / share if 0.0 < share < 1.0 else 0.0  # (the decoder's time for a whole batch)
        if gpu * whole_decoder > steps:  # (the decoder would hold the prefetch thread past a step)
            whole_workers = workers / (1.0 - share)
            gpu = whole_workers / (whole_workers + whole_decoder)
        if gpu < self.LEAST or any(abs(gpu - tried) < self.LEAST for tried in self.candidates):
            return None
        return round(gpu, 2)

    def _next(self, figures: tuple[float, float, float] | None) -> None:
        self.results.append(figures)
        self.index, self.waited, self.made, self.stamps = self.index + 1, 0, 0, []
        share = self.following()
        if share is not None:
            self.candidates.append(share)
            self.splits[0].gpu_share = share
            return
        self.done = True
        timed = [(f[0], k) for k, f in enumerate(self.results) if f is not None]
        if not timed:
            return
        best = min(timed)[1]
        if self.results[0] is not None and self.results[0][0] <= self.results[best][0] * (1 + self.TIE):
            best = 0  # (the workers alone win a tie)
        for split in self.splits:
            split.gpu_share = self.candidates[best]
        figures = ", ".join(
            f"{self.said(self.candidates[k])} {1000 * t:.1f} ms (steps {1000 * self.results[k][1]:.1f}, workers "
            f"{1000 * self.results[k][2]:.1f}, prefetch thread {1000 * self.results[k][3]:.1f})" for t, k in timed)
        log.info("data.decode=auto: kept %s (a training batch every, over %d batches after the first %d: %s); "
                 "data.decode=cpu or gpu picks one", self.said(self.candidates[best]), self.MEASURE, self.SETTLE,
                 figures)


def default_workers(cfg) -> int:
    """This rank's DataLoader workers: data.workers, or as the launcher counts them when null
    (launcher/data/loader.py): the cores this process may use, shared by the ranks on this machine
    (LOCAL_WORLD_SIZE), less one."""
    if cfg.data.workers is not None:
        return int(cfg.data.workers)
    from launcher.data.loader import default_workers as launchers

    return launchers(int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))


class ImageFolder(Recipe):
    Config = ImageFolderConfig
    hp: ImageFolderConfig
    unit = "images"

    def __init__(self, cfg):
        super().__init__(cfg)
        self.decode = "cpu"  # where this worker's batches are decoded (decided in load)
        self.trial: DecodeTrial | None = None  # data.decode=auto's measured choice (load)
        self._slots: PinnedSlots | None = None  # the training batches' shared buffers (load, under Regions)
        self._normalize = Normalizer(bool(cfg.perf.channels_last))

    def prepare(self) -> None:
        """Check the folder's layout (in the launcher, once; no image is opened), and say what linked paths
        the scan left out."""
        root = data_root(self.cfg)
        said = left_out_line(root, scan(root))
        if said:
            print(f"launch: warning: {said}", file=sys.stderr, flush=True)

    def decode_plan(self, cuda: bool) -> tuple[str, float]:
        """(cpu | gpu | auto, the share of samples meant for the GPU decoder), said in one log line."""
        asked = str(self.cfg.data.decode)
        if asked == "cpu" or not cuda:
            where = ("the DataLoader workers decode" if default_workers(self.cfg) > 0 else
                     "the training process decodes (data.workers=0)")
            if asked == "gpu":
                log.warning("data.decode=gpu: no CUDA device here; %s the images instead (as data.decode=cpu)", where)
            elif asked == "auto":
                log.info("data.decode=auto: no CUDA device, so %s (PIL)", where)
            return "cpu", 0.0
        hardware = (torch.cuda.is_available()
                    and hardware_decoder(torch.device("cuda", torch.cuda.current_device())) is not None)
        decoder = ("nvImageCodec (the GPU's hardware JPEG decoders where it has them)" if hardware else
                   "torchvision's nvJPEG (pip install nvidia-nvimgcodec-cu13[nvjpeg] -- or -cu12 -- decodes on the "
                   "GPU's hardware JPEG decoders instead, leaving the SMs to training)")
        resized = " (which leave the resizing of their crops to the GPU)" if self.resizes_on_gpu() else ""
        if asked == "gpu":
            log.info("data.decode=gpu: JPEGs decoded in batches on the GPU by %s, off the compute stream; other "
                     "files (PNG, grey, CMYK, progressive) by the DataLoader workers%s", decoder, resized)
            return "gpu", 1.0
        workers = default_workers(self.cfg)
        if workers == 0:
            log.info("data.decode=auto: no DataLoader workers (data.workers=0), so the GPU decodes (%s)", decoder)
            return "auto", 1.0
        when = (" of the second epoch (the first one's pace is not the run's: compiling, the workers starting)"
                if self.cfg.epochs > 1 else "")
        log.info("data.decode=auto: the first training batches%s are decoded by the %d DataLoader workers alone "
                 "(PIL)%s and timed; if the workers do not keep up with the steps, each batch is then split between "
                 "them and the GPU (%s) in the proportion those times give; the faster way is kept and said", when,
                 workers, resized, decoder)
        return "auto", 0.0

    SLOT_MEMORY = 0.25  # of the host's memory, at most, for the ranks' PinnedSlots together

    def batch_slots(self) -> PinnedSlots | None:
        """Shared, page-locked buffers for the training batches of Regions (launcher/data/slots.py): each
        worker gets its prefetch's worth plus two, each slot twice a batch of decoded crops (a batch of
        Regions averaged 0.9x that on the generated ImageNet-like folder), within SLOT_MEMORY of the host's
        memory and half of /dev/shm's free space; None without workers, or where that memory cannot be had."""
        workers = default_workers(self.cfg)
        if workers < 1:
            return None
        nbytes = 2 * int(self.cfg.batch_size) * self.hp.image_size ** 2 * 3
        ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
        room = int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") * self.SLOT_MEMORY) // ranks
        try:  # (and half of what /dev/shm has free, shared with the batches that find no slot: a container's
            shm = os.statvfs("/dev/shm")  # /dev/shm may be small, and a write past it kills the worker)
            room = min(room, shm.f_bavail * shm.f_frsize // 2 // ranks)
        except OSError:
            pass
        per_worker = min(int(self.cfg.data.worker_prefetch) + 2, room // (workers * nbytes))
        if per_worker < 1:
            log.info("data: no shared batch slots (%d workers x %d MB do not fit in %d MB); batches of crops go "
                     "through the DataLoader's pinning", workers, nbytes >> 20, room >> 20)
            return None
        try:
            return PinnedSlots(workers, per_worker, nbytes)
        except RuntimeError as exc:  # (shared memory too small: a container's /dev/shm)
            log.warning("data: no shared batch slots (%s); batches of crops go through the DataLoader's pinning", exc)
            return None

    @staticmethod
    def resizes_on_gpu() -> bool:
        """Whether the crops the workers decode (under data.decode=gpu/auto) are resized on the GPU: where
        image_kernels' one kernel runs there (CUDA with Triton), which leaves the workers decoding alone."""
        from launcher.data import image_kernels

        return torch.cuda.is_available() and image_kernels.usable(torch.device("cuda", torch.cuda.current_device()))

    def load(self) -> tuple[ImageFolderSplit, ImageFolderSplit]:
        folders = scan(data_root(self.cfg))
        self.decode, gpu_share = self.decode_plan(torch.cuda.is_available())
        common = dict(image_size=self.hp.image_size, eval_resize=self.hp.eval_side, min_scale=self.hp.min_scale,
                      seed=self.cfg.seed, gpu_share=gpu_share, skip_bad=str(self.cfg.data.on_bad_file) == "skip",
                      regions=self.decode != "cpu" and self.resizes_on_gpu())
        splits = (ImageFolderSplit(folders["train"], train=True, **common),
                  ImageFolderSplit(folders["val"], train=False, **common))
        if common["regions"]:
            splits[0].slots = self._slots = self.batch_slots()
        if self.decode == "auto" and gpu_share < 1.0:
            # The first epoch's batches do not pace the run: they span compiling (perf.compile=auto decides at
            # its end), the warm-up, the workers' start (on two H200s the first epoch ran at a third of the
            # others' speed, and the workers alone timed there came out at 136 ms a step for 39). So the
            # trial times the second epoch's.
            later = self.cfg.epochs > 1
            self.trial = DecodeTrial(splits, start_after=len(splits[0]) // max(1, int(self.cfg.batch_size))
                                     if later else 0, pace=self._steps_pace)
        return splits

    def _steps_pace(self, n: int) -> float | None:
        """The median own time of the last `n` training steps on the GPU (the loop's StepPace), if known."""
        return self.step_pace.median_s(n) if self.step_pace is not None else None

    def collate(self, samples: list[Any]) -> Any:
        return collate(samples)

    def on_after_batch_transfer(self, batch: Any, training: bool) -> Any:
        if not (training and self.trial is not None and not self.trial.done):
            return self._on_device(batch)
        samples, gpu_samples = len(batch[1]), len(batch[3].jpegs) if len(batch) == 4 else 0
        began = time.perf_counter()
        out = self._on_device(batch)
        self.trial.batch(samples, gpu_samples, time.perf_counter() - began)
        return out

    def _on_device(self, batch: Any) -> Any:
        if len(batch) == 4:  # some samples still to decode or resize (see collate)
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
