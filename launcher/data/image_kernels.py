"""One GPU kernel for recipe=imagefolder's decoded batch: every image's crop box resized to S x S, flipped where
asked and normalized, straight from the decoder's own buffers into the batch.

    crop_resize_normalize(images, boxes, flips, rows, out, mean, std)
    crop_resize_normalize_flat(flat, offsets, shapes, boxes, flips, rows, out, mean, std)

`images` are the decoded images of any size (each a tensor, or an object with `__cuda_array_interface__`:
nvImageCodec's), in any layout (HWC or CHW: their strides say); `out` is the batch, float, (N, 3, S, S), any
memory format; image k goes to row `rows[k]`. The `_flat` form takes images laid one after another in one
uint8 buffer (HWC), described by tables alone: the crops DataLoader workers decoded, handed over unresized.
The arithmetic is torchvision's `roi_align(aligned=True, sampling_ratio=0)` per pixel (the mean of
ceil(box/S)^2 bilinear samples: an antialiased downscale), with reads clamped at the image's edges, then
(x - mean) / std.

Why one kernel: the same work in torch ops costs ~8 small copies and views per image (for a batch of 256
images, much of the host's time and of the GPU's, on an H100; measured: BENCHMARKS.md section 6), and that
host time is the Python thread's that feeds the GPU, holding the GIL the training step needs. Here the host
builds two small tables and launches one Triton kernel.

Where Triton cannot run (no CUDA, no triton), `crop_resize` (torch ops, the reference) does the work.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any

import torch

GEO_COLUMNS = 10  # offset, height, width, channel/row/column strides, output row, flip, samples down, across

try:
    import triton
    import triton.language as tl
except ImportError:  # (CPU-only installs)
    triton = None


if triton is not None:
    @triton.jit
    def _bilinear(channel, r_lo, r_hi, c_lo, c_hi, w00, w01, w10, w11, mask):
        """One channel's bilinear sample: its four neighbours (rows r_lo/r_hi, columns c_lo/c_hi), weighted."""
        return (w00 * tl.load(channel + r_lo + c_lo, mask=mask, other=0).to(tl.float32)
                + w01 * tl.load(channel + r_lo + c_hi, mask=mask, other=0).to(tl.float32)
                + w10 * tl.load(channel + r_hi + c_lo, mask=mask, other=0).to(tl.float32)
                + w11 * tl.load(channel + r_hi + c_hi, mask=mask, other=0).to(tl.float32))

    @triton.jit
    def _kernel(src, geo, boxes, out, out_sn, out_sc, out_sy, out_sx, mean0, mean1, mean2, inv0, inv1, inv2,
                S: tl.constexpr, BLOCK: tl.constexpr):
        i = tl.program_id(0)
        g = geo + i * 10
        offset = tl.load(g)
        h = tl.load(g + 1)
        w = tl.load(g + 2)
        sc = tl.load(g + 3)
        sy = tl.load(g + 4)
        sx = tl.load(g + 5)
        row = tl.load(g + 6)
        flip = tl.load(g + 7)
        gh = tl.load(g + 8).to(tl.int32)
        gw = tl.load(g + 9).to(tl.int32)
        x0 = tl.load(boxes + i * 4)
        y0 = tl.load(boxes + i * 4 + 1)
        bin_w = (tl.load(boxes + i * 4 + 2) - x0) / S
        bin_h = (tl.load(boxes + i * 4 + 3) - y0) / S
        p = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = p < S * S
        oy = p // S
        ox = p % S
        top = (h - 1).to(tl.float32)
        right = (w - 1).to(tl.float32)
        step_h = bin_h / gh.to(tl.float32)
        step_w = bin_w / gw.to(tl.float32)
        a0 = tl.zeros([BLOCK], dtype=tl.float32)
        a1 = tl.zeros([BLOCK], dtype=tl.float32)
        a2 = tl.zeros([BLOCK], dtype=tl.float32)
        base = src + offset
        for iy in range(0, gh):
            yy = y0 - 0.5 + oy.to(tl.float32) * bin_h + (iy + 0.5) * step_h
            yy = tl.minimum(tl.maximum(yy, 0.0), top)
            yl = yy.to(tl.int32)
            ly = yy - yl.to(tl.float32)
            yh = tl.minimum(yl + 1, (h - 1).to(tl.int32))
            r_lo = yl.to(tl.int64) * sy
            r_hi = yh.to(tl.int64) * sy
            for ix in range(0, gw):
                xx = x0 - 0.5 + ox.to(tl.float32) * bin_w + (ix + 0.5) * step_w
                xx = tl.minimum(tl.maximum(xx, 0.0), right)
                xl = xx.to(tl.int32)
                lx = xx - xl.to(tl.float32)
                xh = tl.minimum(xl + 1, (w - 1).to(tl.int32))
                c_lo = xl.to(tl.int64) * sx
                c_hi = xh.to(tl.int64) * sx
                w00 = (1.0 - ly) * (1.0 - lx)
                w01 = (1.0 - ly) * lx
                w10 = ly * (1.0 - lx)
                w11 = ly * lx
                a0 += _bilinear(base, r_lo, r_hi, c_lo, c_hi, w00, w01, w10, w11, mask)
                a1 += _bilinear(base + sc, r_lo, r_hi, c_lo, c_hi, w00, w01, w10, w11, mask)
                a2 += _bilinear(base + 2 * sc, r_lo, r_hi, c_lo, c_hi, w00, w01, w10, w11, mask)
        count = (gh * gw).to(tl.float32)
        dx = tl.where(flip != 0, S - 1 - ox, ox)
        dst = out + row * out_sn + oy.to(tl.int64) * out_sy + dx.to(tl.int64) * out_sx
        tl.store(dst, (a0 / count - mean0) * inv0, mask=mask)
        tl.store(dst + out_sc, (a1 / count - mean1) * inv1, mask=mask)
        tl.store(dst + 2 * out_sc, (a2 / count - mean2) * inv2, mask=mask)


class _Span:
    """A uint8 view of device memory from `pointer`, `size` bytes long (for torch.as_tensor): the images'
    buffers, wherever their allocators put them, addressed as offsets from the lowest one."""

    def __init__(self, pointer: int, size: int):
        self.__cuda_array_interface__ = {"shape": (size,), "typestr": "|u1", "data": (pointer, False), "version": 2}


def _layout(image: Any) -> tuple[int, int, int, int, int, int, int]:
    """(pointer, bytes spanned, height, width, channel stride, row stride, column stride) of a 3-channel
    uint8 image: a CHW tensor, or an HWC `__cuda_array_interface__` object (nvImageCodec's Image)."""
    if isinstance(image, torch.Tensor):
        c, h, w = image.shape
        sc, sy, sx = image.stride()
        return image.data_ptr(), (c - 1) * sc + (h - 1) * sy + (w - 1) * sx + 1, h, w, sc, sy, sx
    face = image.__cuda_array_interface__
    h, w, c = face["shape"]
    sy, sx, sc = face.get("strides") or (w * c, c, 1)
    return face["data"][0], (h - 1) * sy + (w - 1) * sx + (c - 1) * sc + 1, h, w, sc, sy, sx


def _dense(image: torch.Tensor) -> bool:
    """Whether the tensor's elements fill its memory without gaps (any order of its dimensions)."""
    order = sorted(zip(image.stride(), image.shape, strict=True))
    expected = 1
    for stride, size in order:
        if size > 1 and stride != expected:
            return False
        expected *= size
    return True


def usable(device: torch.device) -> bool:
    """Whether the kernel runs for `device` (CUDA with Triton; the CPU under TRITON_INTERPRET=1)."""
    if triton is None:
        return False
    if device.type == "cuda":
        return True
    return os.environ.get("TRITON_INTERPRET") == "1"


def crop_resize_normalize(images: Sequence[Any], boxes: torch.Tensor, flips: torch.Tensor, rows: torch.Tensor,
                          out: torch.Tensor, mean: Sequence[float], std: Sequence[float], block: int = 1024) -> None:
    """Fill `out[rows[k]]` with image k's box (x0, y0, x1, y1, pixel edges) resized to S x S, flipped where
    `flips[k]`, normalized. Host tensors boxes, flips, rows (the batch's tables); one kernel on the current
    stream. The images must stay alive until it ran (a caller's tensors on the same stream do)."""
    if not len(images):
        return
    layouts = [_layout(img) for img in images]
    device = out.device
    if device.type == "cuda":
        low = min(layout[0] for layout in layouts)
        high = max(layout[0] + layout[1] for layout in layouts)
        src = torch.as_tensor(_Span(low, high - low), device=device)
        offsets = [layout[0] - low for layout in layouts]
    else:  # (the interpreter reads host memory: each image's own bytes, in its own layout, one after another)
        dense = [img if _dense(img) else img.contiguous() for img in images]
        flat = [torch.as_strided(img, (img.numel(),), (1,), img.storage_offset()) for img in dense]
        src = torch.cat(flat)
        offsets, start = [], 0
        for f in flat:
            offsets.append(start)
            start += f.numel()
        layouts = [(0, 0, img.shape[1], img.shape[2], *img.stride()) for img in dense]
    _launch(src, [[off, *layout[2:]] for off, layout in zip(offsets, layouts, strict=True)], boxes, flips, rows,
            out, mean, std, block)


def crop_resize_normalize_flat(flat: torch.Tensor, offsets: torch.Tensor, shapes: torch.Tensor, boxes: torch.Tensor,
                               flips: torch.Tensor, rows: torch.Tensor, out: torch.Tensor, mean: Sequence[float],
                               std: Sequence[float], block: int = 1024) -> None:
    """As crop_resize_normalize, for images laid one after another in one uint8 buffer `flat` (on out's
    device): image k is HWC, 3 channels, `shapes[k]` = (height, width), from byte `offsets[k]`. Host tables;
    no per-image object at all (what DataLoader workers hand over: their decoded crops, not yet resized)."""
    if not len(offsets):
        return
    heights, widths = shapes[:, 0].to(torch.int64), shapes[:, 1].to(torch.int64)
    geo = torch.stack([offsets.to(torch.int64), heights, widths, torch.ones_like(heights), widths * 3,
                       torch.full_like(heights, 3)], dim=1)
    _launch(flat, geo, boxes, flips, rows, out, mean, std, block)


def _launch(src: torch.Tensor, geo: Any, boxes: torch.Tensor, flips: torch.Tensor, rows: torch.Tensor,
            out: torch.Tensor, mean: Sequence[float], std: Sequence[float], block: int) -> None:
    """The kernel over `src` (uint8, 1-D) for images described by `geo`'s rows: (offset in src, height, width,
    channel, row and column strides)."""
    size = out.shape[-1]
    device = out.device
    boxes = boxes.to(torch.float32).cpu().contiguous()
    grid_h = torch.ceil((boxes[:, 3] - boxes[:, 1]) / size).clamp_(min=1).to(torch.int64)
    grid_w = torch.ceil((boxes[:, 2] - boxes[:, 0]) / size).clamp_(min=1).to(torch.int64)
    geo = torch.as_tensor(geo, dtype=torch.int64)
    geo = torch.cat([geo, rows.cpu().view(-1, 1).to(torch.int64), flips.cpu().view(-1, 1).to(torch.int64),
                     grid_h.view(-1, 1), grid_w.view(-1, 1)], dim=1)
    pinned = device.type == "cuda"
    if pinned:
        geo, boxes = geo.pin_memory(), boxes.pin_memory()
    geo = geo.to(device, non_blocking=pinned)
    boxes = boxes.to(device, non_blocking=pinned)
    inv = [1.0 / s for s in std]
    grid = (len(geo), math.ceil(size * size / block))
    _kernel[grid](src, geo, boxes, out, *out.stride(), float(mean[0]), float(mean[1]), float(mean[2]),
                  inv[0], inv[1], inv[2], S=size, BLOCK=block)
