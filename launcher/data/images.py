"""Images for the training step, made in the DataLoader workers: crops drawn per sample, decoded on the CPU,
or handed over for the GPU to finish (gpu_decode.py), batched by `collate`. The Dataset is ImageFolderSplit,
one split of a folder that folders.py scanned. Where the images are decoded is `data.decode`:

  cpu   the worker decodes with PIL (JPEGs at reduced size via `draft` when the crop allows), converts any
        mode to RGB, crops (training: RandomResizedCrop(image_size, scale=(min_scale, 1)) + a random
        horizontal flip; evaluation: the shorter side resized to eval_resize, then a center crop; resized
        by torch's antialiased uint8 kernel, PIL's filter at less cost; measured: BENCHMARKS.md section 12),
        and hands over uint8 CHW crops. The GPU only normalizes them.
  gpu   the worker reads the file's bytes and the JPEG's header (its size) and draws the crop box (an
        `Encoded` sample); the GPU decodes the batch's JPEGs and crops, resizes, flips and normalizes them
        (gpu_decode.py). Files nvJPEG cannot or should not take (PNG, BMP, WebP, grey, CMYK and progressive
        JPEGs, a JPEG without its end marker) are decoded by the worker as for cpu; the batch carries both
        kinds. On CUDA (where image_kernels runs) the worker does not resize what it decodes: it hands over
        the pixels around the crop box (at draft's reduced size) as a Region, the batch's Regions one after
        another in one buffer (a PinnedSlots slot for training batches: slots.py), and the same kernel
        resizes them on the GPU. The resize was a third of a sample's host time (measured: BENCHMARKS.md
        section 12).
  auto  on CUDA, measured in the run: the workers alone, or each batch split between them and the GPU's
        decoder (decode_trial.py). Without CUDA: cpu.

Augmentation is drawn per sample from (seed, epoch, sample index), so a resumed run repeats it: the
launcher tells the dataset the epoch with `set_epoch(epoch)` in the process that reads a batch, before its
first batch of that epoch (the epoch travels with the batch's indices, so workers may read the next
epoch's first batches while this one's last ones train: loader.py). Until it is told, the draw mixes in
the DataLoader's per-epoch base seed instead of the epoch (new crops every epoch, repeated on resume only
as far as that seed is).

A file that cannot be read or decoded stops the run with one line naming it (data.on_bad_file=error), or
is left out of its batch and counted by the launcher (skip: the Dataset returns None for it).
"""

from __future__ import annotations

import io
import logging
import math
import os
import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image

from launcher.data.decode_trial import LeftToGpu, SharedDecode, mix
from launcher.data.folders import Folder
from launcher.data.slots import PinnedSlots
from launcher.errors import LaunchError

log = logging.getLogger("launcher.train")

# ImageNet's per-channel mean and std, in 0..255 pixel units
MEAN = (0.485 * 255, 0.456 * 255, 0.406 * 255)
STD = (0.229 * 255, 0.224 * 255, 0.225 * 255)


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



_SKIPPED: set[str] = set()  # the files this process said it left out (data.on_bad_file=skip)


def said_skipped(path: str, exc: BaseException) -> None:
    """data.on_bad_file=skip: name a file left out, once per process that reads it (the launcher counts them)."""
    if path not in _SKIPPED:
        _SKIPPED.add(path)
        reason = str(exc).strip().splitlines()[0][:120] if str(exc).strip() else ""
        log.warning("data.on_bad_file=skip: left out %s (%s%s)", path, type(exc).__name__,
                    f": {reason}" if reason else "")



# ---- drawing crops ------------------------------------------------------------------------------------------


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
    sample's work (the resize, on a Xeon core; measured: BENCHMARKS.md section 12)."""
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
    vectorized uint8 kernel: faster than PIL's own on one core; measured: BENCHMARKS.md section 12): uint8
    CHW, contiguous."""
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


class GpuWork(LeftToGpu):
    """What a mixed batch leaves to the GPU (see `collate`): its JPEGs to decode, and where its workers'
    crops are not resized yet, their Regions (None: they are size x size already). Neither a tensor nor a
    container, so the DataLoader's pinning and the launcher's copy to the device leave it on the host."""

    def __init__(self, jpegs: HostJpegs, regions: Regions | None):
        self.jpegs, self.regions = jpegs, regions

    def gpu_samples(self) -> int:
        return len(self.jpegs)


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


class ImageFolderSplit(SharedDecode):
    """One split of the folder. A sample is `(image, label)`: image a uint8 CHW crop (decode cpu), or for
    the GPU an `Encoded` JPEG (decode gpu/auto, where the file suits nvJPEG; `gpu_share` of the samples) or
    a `Region` (the workers' crops not resized yet); None when the file is bad and on_bad_file is skip.
    `classes`, `samples` and `targets` as torchvision's ImageFolder has them."""

    def __init__(self, folder: Folder, *, train: bool, image_size: int, eval_resize: int, min_scale: float = 0.08,
                 seed: int = 0, gpu_share: float = 0.0, skip_bad: bool = False, draft: bool = True,
                 regions: bool = False):
        super().__init__(gpu_share)
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
        self.slots: PinnedSlots | None = None  # where its workers' batches of Regions go (the recipe's load)
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
        return random.Random(mix(self.seed, epoch, index))

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
        if slot is not None:  # (written where the training process copies it to the GPU from: slots.py)
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
