"""Probe (issue 33): what data.decode=cpu's work costs a core, part by part, and what W worker processes make.

    python bench/probe/cpu_decode.py --root /tmp/imagenet-gen [--n 400] [--processes 1 15]

On the training images of an ImageNet-layout folder (bench/imagefolder.py makes one), one JSON line each:
  parts      one core (torch on one thread, as in a DataLoader worker), collate's stacking of 256 crops
             (HWC memory viewed as CHW, as the crops were, against contiguous CHW), and ms a sample: opening the file,
             decoding it (PIL, with `draft` as the recipe sets it), resizing the crop with PIL's filter and
             with torch's antialiased uint8 kernel (what the recipe uses), and the whole sample as the
             recipe makes it (recipes/imagefolder.py decode_train_crop) against the same with PIL's resize
  processes  P processes decoding the same samples at once, as P DataLoader workers do: img/s in all
and the machine's CPU model and torch's vector capability.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import platform
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def _jobs(root: Path, n: int) -> list[tuple[str, tuple[int, int, int, int], bool]]:
    from launcher.recipes.imagefolder import random_resized_crop_box

    every = sorted((root / "train").glob("*/*"))
    paths = every[:: max(1, len(every) // n)][:n]
    rng = random.Random(0)
    jobs = []
    for p in paths:
        with Image.open(p) as img:
            box = random_resized_crop_box(rng, *img.size, (0.08, 1.0))
        jobs.append((str(p), box, rng.random() < 0.5))
    return jobs


def pil_crop(img: Image.Image, box, size: int, flip: bool) -> torch.Tensor:
    """The recipe's training crop as it was made before c233851: PIL's resize of the box, PIL's flip."""
    from launcher.recipes.imagefolder import _draft, to_rgb

    left, top, w, h = box
    width, height = img.size
    _draft(img, width * size / w, height * size / h)
    img = to_rgb(img)
    sx, sy = img.size[0] / width, img.size[1] / height
    out = img.resize((size, size), Image.Resampling.BILINEAR,
                     box=(left * sx, top * sy, (left + w) * sx, (top + h) * sy), reducing_gap=None)
    if flip:
        out = out.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return torch.from_numpy(np.array(out)).permute(2, 0, 1)


def _per_sample_ms(fn, jobs, repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for job in jobs:
            fn(*job)
        best = min(best, time.perf_counter() - start)
    return round(1000 * best / len(jobs), 4)


def parts(jobs, size: int) -> dict:
    from launcher.recipes.imagefolder import _draft, _hwc, _resize, decode_train_crop, to_rgb

    torch.set_num_threads(1)

    def opened(path, box, flip):
        with Image.open(path) as img:
            return img.size

    def decoded(path, box, flip):
        with Image.open(path) as img:
            left, top, w, h = box
            _draft(img, img.size[0] * size / w, img.size[1] * size / h)
            img.load()

    pictures = []
    for path, box, _ in jobs:
        img = Image.open(path)
        left, top, w, h = box
        width, height = img.size
        _draft(img, width * size / w, height * size / h)
        img = to_rgb(img)
        sx, sy = img.size[0] / width, img.size[1] / height
        pictures.append((img, (left * sx, top * sy, (left + w) * sx, (top + h) * sy)))

    def pil_resize(img, box):
        img.resize((size, size), Image.Resampling.BILINEAR, box=box, reducing_gap=None)

    def torch_resize(img, box):
        x0, y0, x1, y1 = (round(v) for v in box)
        _resize(_hwc(img)[y0:y1, x0:x1], size, size)

    def whole(path, box, flip):
        with Image.open(path) as img:
            decode_train_crop(img, box, size, flip)

    def whole_pil(path, box, flip):
        with Image.open(path) as img:
            pil_crop(img, box, size, flip)

    crops = []
    for path, box, flip in (jobs * 2)[:256]:
        with Image.open(path) as img:
            crops.append(decode_train_crop(img, box, size, flip))
    views = [c.permute(1, 2, 0).contiguous().permute(2, 0, 1) for c in crops]  # (HWC memory: the old crops)

    def stack(tensors, _box=None, _flip=None):
        torch.stack(tensors)

    collate = {"collate_256_old_views_ms": _per_sample_ms(stack, [(views,)]),
               "collate_256_now_ms": _per_sample_ms(stack, [(crops,)])}
    return {"what": "parts", **collate, "ms_per_sample": {
        "open": _per_sample_ms(opened, jobs), "decode": _per_sample_ms(decoded, jobs),
        "resize_pil": _per_sample_ms(pil_resize, pictures), "resize_torch_incl_copy_out_of_pil":
            _per_sample_ms(torch_resize, pictures),
        "sample_recipe": _per_sample_ms(whole, jobs), "sample_pil_resize": _per_sample_ms(whole_pil, jobs)}}


PASSES = 4  # each process goes over the samples this many times (a longer, steadier figure)


def _worker(jobs, size: int, pil: bool, start, out) -> None:
    from launcher.recipes.imagefolder import decode_train_crop

    torch.set_num_threads(1)
    start.wait()
    began = time.perf_counter()
    for _ in range(PASSES):
        for path, box, flip in jobs:
            with Image.open(path) as img:
                (pil_crop if pil else decode_train_crop)(img, box, size, flip)
    out.put((PASSES * len(jobs), time.perf_counter() - began))


def processes(jobs, size: int, count: int, pil: bool) -> dict:
    ctx = mp.get_context("fork")
    start, out = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(jobs, size, pil, start, out)) for _ in range(count)]
    for p in procs:
        p.start()
    began = time.perf_counter()
    start.set()
    done = [out.get() for _ in procs]
    wall = time.perf_counter() - began
    for p in procs:
        p.join()
    return {"what": "processes", "processes": count, "resize": "pil" if pil else "torch",
            "img_per_s": round(sum(n for n, _ in done) / wall, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", default="/tmp/imagenet-gen")
    p.add_argument("--n", type=int, default=400, help="samples (spread over the folder)")
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--processes", type=int, nargs="*", default=[1])
    args = p.parse_args()
    model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
                 platform.processor())
    print(json.dumps({"cpu": model, "cores": len(__import__("os").sched_getaffinity(0)),
                      "torch": torch.__version__, "capability": torch.backends.cpu.get_cpu_capability(),
                      "pillow": Image.__version__}), flush=True)
    jobs = _jobs(Path(args.root), args.n)
    print(json.dumps(parts(jobs, args.size)), flush=True)
    for count in args.processes:
        for pil in (True, False):
            print(json.dumps(processes(jobs, args.size, count, pil)), flush=True)


if __name__ == "__main__":
    main()
