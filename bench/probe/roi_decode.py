"""Probe (issue 33): what decoding only a crop's region saves on the GPU, with nvImageCodec's hardware decoder.

    python bench/probe/roi_decode.py [--root /tmp/imagenet-gen] [--batch 190] [--reps 20]

Takes --batch training JPEGs of the generated folder (bench/imagefolder.py makes it), draws each one's
RandomResizedCrop box as recipe=imagefolder does, and decodes the batch on the GPU's JPEG engines three
ways: the whole images (what the recipe does today), only each box's region (nvImageCodec's
CodeStream.get_sub_code_stream(region=...)), and the region rounded out to the JPEG's 16-pixel blocks.
For each: img/s of the decode alone (the batch split between two decoders in two threads, as the recipe
does, and in one call), and the SM kernels it launched (torch.profiler: the GPU's own CUDA time a batch,
what training would lose to it). Checks that a region's pixels are the whole image's within rounding.
Also times the recipe's crop kernel on the whole and the region images, and one core's PIL decode + crop
(the CPU path: data.decode=cpu's rate per worker on this host). One JSON line per measurement.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def gpu_events(fn) -> list:
    """The GPU's events (kernels, copies) while `fn` runs, through torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def kernels(fn) -> dict:
    """The GPU time `fn` took (ms, summed) and its top six events by time: [name, ms, count]."""
    by: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in gpu_events(fn):
        by[e.name[:80]][0] += e.device_time_total / 1000
        by[e.name[:80]][1] += 1
    top = sorted(by.items(), key=lambda kv: -kv[1][0])[:6]
    return {"kernel_ms": round(sum(v[0] for v in by.values()), 3),
            "top": [[k, round(v[0], 3), v[1]] for k, v in top]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", default="/tmp/imagenet-gen")
    p.add_argument("--n", type=int, default=20_000)
    p.add_argument("--batch", type=int, default=190)
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args()
    import imagefolder as bench  # bench/imagefolder.py
    from nvidia import nvimgcodec
    from PIL import Image

    from launcher.recipes import image_kernels
    from launcher.recipes.imagefolder import MEAN, STD, decode_train_crop, random_resized_crop_box

    bench.make_folder(Path(args.root), args.n, 100)
    files = sorted(Path(args.root, "train").rglob("*.JPEG"))
    rng = random.Random(0)
    pick = rng.sample(files, args.batch)
    datas, boxes = [], []
    for f in pick:
        data = f.read_bytes()
        with Image.open(f) as img:
            w, h = img.size
        datas.append(data)
        boxes.append(random_resized_crop_box(rng, w, h, (0.08, 1.0)))
    area = sum(bw * bh for _, _, bw, bh in boxes) / sum(
        Image.open(f).size[0] * Image.open(f).size[1] for f in pick)
    print(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                      "nvimgcodec": nvimgcodec.__version__, "batch": args.batch,
                      "box_area_share": round(area, 3)}), flush=True)

    backends = [nvimgcodec.Backend(nvimgcodec.BackendKind.HW_GPU_ONLY)]
    decoders = [nvimgcodec.Decoder(device_id=0, backends=backends) for _ in range(2)]
    params = nvimgcodec.DecodeParams(apply_exif_orientation=False, color_spec=nvimgcodec.ColorSpec.SRGB,
                                     sample_format=nvimgcodec.SampleFormat.I_RGB)
    streams = [torch.cuda.current_stream(), torch.cuda.Stream()]
    pool = ThreadPoolExecutor(1)

    def sources(mode: str) -> list:
        out = []
        for data, (x, y, bw, bh) in zip(datas, boxes, strict=True):
            cs = nvimgcodec.CodeStream(data)
            if mode == "whole":
                out.append(cs)
                continue
            x0, y0, x1, y1 = x, y, x + bw, y + bh
            if mode == "blocks":  # out to the 16-pixel MCU grid
                x0, y0 = x0 // 16 * 16, y0 // 16 * 16
                x1, y1 = min(cs.width, -(-x1 // 16) * 16), min(cs.height, -(-y1 // 16) * 16)
            out.append(cs.get_sub_code_stream(region=nvimgcodec.Region(y0, x0, y1, x1)))
        return out

    def decode(srcs: list, parts: int) -> list:
        if parts == 1:
            return list(decoders[0].decode(srcs, params=params, cuda_stream=streams[0].cuda_stream))
        half = len(srcs) // 2
        other = pool.submit(lambda: list(decoders[1].decode(srcs[half:], params=params,
                                                             cuda_stream=streams[1].cuda_stream)))
        first = list(decoders[0].decode(srcs[:half], params=params, cuda_stream=streams[0].cuda_stream))
        return first + other.result()

    results = {}
    for mode in ("whole", "region", "blocks"):
        srcs = sources(mode)
        try:
            images = decode(srcs, 1)
        except Exception as exc:  # noqa: BLE001 - a probe: say what failed
            print(json.dumps({"mode": mode, "error": f"{type(exc).__name__}: {exc}"}), flush=True)
            continue
        torch.cuda.synchronize()
        none = sum(img is None for img in images)
        results[mode] = images
        row = {"mode": mode, "failed": none,
               "mean_pixels": round(sum(img.shape[0] * img.shape[1] for img in images if img is not None)
                                    / max(1, len(images) - none))}
        for parts in (1, 2):
            decode(srcs, parts)
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(args.reps):
                decode(sources(mode), parts)
                torch.cuda.synchronize()
            row[f"img_per_s_{parts}"] = round(args.reps * len(srcs) / (time.perf_counter() - start))
        row.update(kernels(lambda mode=mode: decode(sources(mode), 2)))
        print(json.dumps(row), flush=True)

    # a region's pixels against the whole image's
    if "whole" in results and "region" in results:
        diffs = []
        for full, part, (x, y, bw, bh) in zip(results["whole"], results["region"], boxes, strict=True):
            if full is None or part is None:
                continue
            a = torch.as_tensor(full, device="cuda")[y:y + bh, x:x + bw].float()
            b = torch.as_tensor(part, device="cuda").float()
            if a.shape != b.shape:
                diffs.append(("shape", tuple(a.shape), tuple(b.shape)))
                continue
            inner = (a - b).abs()[1:-1, 1:-1]
            diffs.append((float(inner.mean()), float(inner.max()), float((a - b).abs().max())))
        shapes = [d for d in diffs if d[0] == "shape"]
        nums = [d for d in diffs if d[0] != "shape"]
        print(json.dumps({"check": "region vs whole", "shape_mismatch": len(shapes), "first_mismatch": shapes[:2],
                          "mean_abs_inner": round(sum(d[0] for d in nums) / max(1, len(nums)), 4),
                          "max_abs_inner": max((d[1] for d in nums), default=None),
                          "max_abs_edge": max((d[2] for d in nums), default=None)}), flush=True)

    # the crop kernel on the whole images and on the regions
    size = 224
    out = torch.empty((len(datas), 3, size, size), device="cuda").contiguous(memory_format=torch.channels_last)
    flips = torch.zeros(len(datas), dtype=torch.bool)
    rows = torch.arange(len(datas))
    for mode in results:
        imgs = results[mode]
        if mode == "whole":
            b = torch.tensor([[x, y, x + bw, y + bh] for x, y, bw, bh in boxes], dtype=torch.float32)
        elif mode == "region":
            b = torch.tensor([[0, 0, bw, bh] for _, _, bw, bh in boxes], dtype=torch.float32)
        else:
            b = torch.tensor([[x - x // 16 * 16, y - y // 16 * 16, x - x // 16 * 16 + bw, y - y // 16 * 16 + bh]
                              for x, y, bw, bh in boxes], dtype=torch.float32)

        def crop(imgs=imgs, b=b):
            image_kernels.crop_resize_normalize(imgs, b, flips, rows, out, MEAN, STD)

        crop()
        torch.cuda.synchronize()
        print(json.dumps({"crop_kernel": mode, **kernels(crop)}), flush=True)

    # one core's PIL decode + crop (data.decode=cpu's work per sample; a DataLoader worker runs torch on one thread)
    torch.set_num_threads(1)
    start = time.perf_counter()
    for f, box in zip(pick, boxes, strict=True):
        with Image.open(f) as img:
            decode_train_crop(img, box, size, False)
    print(json.dumps({"pil_one_core_img_per_s": round(len(pick) / (time.perf_counter() - start), 1)}), flush=True)


if __name__ == "__main__":
    main()
