"""The GPU's side of image decoding (data.decode=gpu/auto): a batch's JPEGs decoded on the device, then
cropped, resized, flipped and normalized into the training batch (`gpu_batch`), beside the workers' crops.

`on_after_batch_transfer` (on the launcher's side stream, from its prefetch thread: prefetch.py) hands a
mixed batch (images.py's `collate`) to `gpu_batch`, which decodes its JPEGs on the GPU (nvImageCodec on
the hardware JPEG engines where installed, the batch split between two decoders: HardwareDecoder; else one
batched nvJPEG call, torchvision.io.decode_jpeg on the device), then one Triton kernel (image_kernels.py)
crops and resizes every image straight from the decoder's buffers (roi_align's adaptive sampling: an
antialiased downscale), flips and normalizes it into the batch; the workers' Regions (crops decoded but not
resized) go through the same kernel. Where Triton cannot run, torch ops do the same (`crop_resize`).

`decode_plan` says where a run decodes (data.decode=cpu | gpu | auto, CUDA or not) in one log line.
"""

from __future__ import annotations

import logging
import warnings
from collections import deque
from typing import Any

import torch

from launcher.data.images import MEAN, STD, HostJpegs, Regions, bad_file, said_skipped
from launcher.data.slots import PinnedSlots

log = logging.getLogger("launcher.train")


class HardwareDecoder:
    """nvImageCodec's batched JPEG decoder (the `nvidia-nvimgcodec-cu12`/`-cu13` package, with its nvjpeg
    extra), on the GPU's hardware JPEG engines where it has them (A100, H100, H200: NVJPG, beside the SMs,
    so decoding takes nothing from training), else on its CUDA decoder. A batch is split between PARTS
    decoders, each called from its own thread (the call returns once its images are decoded, with the GIL
    released meanwhile): on an H100 two decoders decoded a batch of 256 faster than one, and four slower than
    two (measured: BENCHMARKS.md section 12). The images are ready on the current stream; their
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
    from launcher.data import image_kernels  # (triton's import, only where a batch needs it)

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
    from launcher.data import image_kernels  # (triton's import, only where a batch needs it)

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


def resizes_on_gpu() -> bool:
    """Whether the crops the workers decode (under data.decode=gpu/auto) are resized on the GPU: where
    image_kernels' one kernel runs there (CUDA with Triton), which leaves the workers decoding alone."""
    from launcher.data import image_kernels  # (triton's import, only where a batch needs it)

    return torch.cuda.is_available() and image_kernels.usable(torch.device("cuda", torch.cuda.current_device()))


def decode_plan(asked: str, cuda: bool, workers: int, epochs: int) -> tuple[str, float]:
    """(cpu | gpu | auto, the share of samples meant for the GPU decoder) for data.decode=`asked` with
    `workers` DataLoader workers on this rank, said in one log line."""
    if asked == "cpu" or not cuda:
        where = ("the DataLoader workers decode" if workers > 0 else
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
    resized = " (which leave the resizing of their crops to the GPU)" if resizes_on_gpu() else ""
    if asked == "gpu":
        log.info("data.decode=gpu: JPEGs decoded in batches on the GPU by %s, off the compute stream; other "
                 "files (PNG, grey, CMYK, progressive) by the DataLoader workers%s", decoder, resized)
        return "gpu", 1.0
    if workers == 0:
        log.info("data.decode=auto: no DataLoader workers (data.workers=0), so the GPU decodes (%s)", decoder)
        return "auto", 1.0
    when = (" of the second epoch (the first one's pace is not the run's: compiling, the workers starting)"
            if epochs > 1 else "")
    log.info("data.decode=auto: the first training batches%s are decoded by the %d DataLoader workers alone "
             "(PIL)%s and timed; if the workers do not keep up with the steps, each batch is then split between "
             "them and the GPU (%s) in the proportion those times give; the faster way is kept and said", when,
             workers, resized, decoder)
    return "auto", 0.0
