"""recipe=imagefolder's data path against the model's limit and torchvision's usual DataLoader, in one process.

    python bench/imagefolder.py                                   (one GPU: 20,000 JPEGs, ResNet-50 @224, batch 256)
    python bench/imagefolder.py --device cpu --n 96 --classes 4 --batch 8 --size 32 --model resnet18 \\
        --workers 2 --steps 3 --no-compile --root /tmp/if-bench       (the script itself checked on a CPU: seconds)

(a) Generates an ImageNet-layout folder of --n JPEGs under --root if it is not there yet: 300-640 px, ~50 KB
    (a smooth random field plus a little noise compresses like a photo), --classes classes; val/ gets a
    twentieth as many. (b) Measures, printing one JSON line each, then a table:
      limit      the model's training step on one batch already on the device (bf16 autocast, channels_last,
                 torch.compile, SGD): what no data path can beat
      baseline   torchvision's ImageFolder + DataLoader (--workers workers, pin_memory): PIL RandomResizedCrop +
                 flip + ToTensor + Normalize in the workers, the same step
      cpu/gpu/auto   recipe=imagefolder's datasets with data.decode=cpu, gpu, and a fixed split (auto:
                 --gpu-share of each batch for the GPU's decoder; a run's data.decode=auto measures its own), fed
                 as the launcher feeds them: a DataLoader with the recipe's collate, then the launcher's
                 CudaPrefetcher (the batch copied on a side stream and on_after_batch_transfer run there, both
                 issued from a thread of its own), the step on the default stream
    and, unless --no-feed, each data path alone (`*-feed`: no step), which says what it could deliver.
    Data paths are timed after their first 2 x workers batches (the ones prefetched before the clock starts).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from multiprocessing import Pool
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


# ---- the folder -------------------------------------------------------------------------------------------


def _write_one(job: tuple[str, int, int]) -> None:
    from PIL import Image

    path, seed, label = job
    rng = np.random.default_rng(seed)
    w, h = (int(v) for v in rng.integers(300, 641, size=2))
    coarse = (rng.random((16, 16, 3)) * 255).astype(np.uint8)
    img = np.asarray(Image.fromarray(coarse).resize((w, h), Image.Resampling.BICUBIC), dtype=np.float32)
    img[..., label % 3] = img[..., label % 3] * 0.7 + 76  # a class tint: the step sees learnable data
    img = np.clip(img + rng.normal(0, 3, img.shape), 0, 255).astype(np.uint8)
    Image.fromarray(img).save(path, "JPEG", quality=90)


def make_folder(root: Path, n: int, classes: int) -> None:
    done = root / ".complete"
    if done.exists():
        return
    jobs = []
    for split, count in (("train", n), ("val", max(classes, n // 20))):
        for i in range(count):
            label = i % classes
            folder = root / split / f"class{label:04d}"
            folder.mkdir(parents=True, exist_ok=True)
            jobs.append((str(folder / f"{split}_{i:07d}.JPEG"), hash((split, i)) & 0xFFFFFFFF, label))
    start = time.perf_counter()
    with Pool(os.cpu_count()) as pool:
        pool.map(_write_one, jobs, chunksize=64)
    done.write_text(f"{n} {classes}\n")
    sizes = [os.path.getsize(j[0]) for j in jobs[:: max(1, len(jobs) // 500)]]
    print(json.dumps({"generated": len(jobs), "root": str(root), "mean_kb": round(float(np.mean(sizes)) / 1000, 1),
                      "seconds": round(time.perf_counter() - start, 1)}), flush=True)


# ---- the step ----------------------------------------------------------------------------------------------


class Step:
    """One SGD training step of the model (bf16 autocast on CUDA, channels_last, compiled unless asked not)."""

    def __init__(self, args, classes: int, device: torch.device):
        import torchvision

        self.device = device
        model = torchvision.models.get_model(args.model, weights=None, num_classes=classes).to(device)
        if device.type == "cuda":
            model = model.to(memory_format=torch.channels_last)
        self.opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4, nesterov=True)
        self.model = torch.compile(model) if args.compile else model
        self.loss = torch.nn.CrossEntropyLoss()

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.device.type == "cuda"):
            loss = self.loss(self.model(x), y)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _busy(path: str, nice: int) -> None:
    """A stand-in DataLoader worker: decodes one JPEG over and over (PIL, with draft) at `nice`."""
    from PIL import Image

    if nice:
        os.nice(nice)
    while True:
        with Image.open(path) as im:
            im.draft("RGB", (im.width // 2, im.height // 2))
            im.convert("RGB").resize((224, 224))


def measure_limit(args, step: Step, device: torch.device, busy: int = 0, nice: int = 0) -> dict:
    """The step on one batch already on the device; `busy`: with that many processes decoding JPEGs beside
    it at `nice` (what the CPU workers of a data path cost the training process's host)."""
    import multiprocessing as mp

    procs = []
    if busy:
        sample = next(iter(sorted((Path(args.root) / "train").glob("*/*.JPEG"))))
        procs = [mp.get_context("fork").Process(target=_busy, args=(str(sample), nice), daemon=True)
                 for _ in range(busy)]
        for proc in procs:
            proc.start()
        time.sleep(1.0)
    try:
        return _measure_limit(args, step, device) | ({"busy": busy, "nice": nice} if busy else {})
    finally:
        for proc in procs:
            proc.kill()
            proc.join()


def _measure_limit(args, step: Step, device: torch.device) -> dict:
    x = torch.randn(args.batch, 3, args.size, args.size, device=device)
    if device.type == "cuda":
        x = x.contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, args.classes, (args.batch,), device=device)
    for _ in range(args.warmup):
        step(x, y)
    sync(device)
    start = time.perf_counter()
    for _ in range(args.steps):
        step(x, y)
    sync(device)
    seconds = time.perf_counter() - start
    return {"what": "limit", "img_per_s": round(args.batch * args.steps / seconds, 1), "steps": args.steps}


# ---- feeding a DataLoader as the launcher does --------------------------------------------------------------


def to_device(batch, device: torch.device):
    """The launcher's copy: every tensor (in tuples, lists, dicts) to the device; other objects stay."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (tuple, list)):
        return type(batch)(to_device(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch


def fed(loader, transfer, device: torch.device, depth: int = 2):
    """Batches copied and transformed on a side stream, `depth` ahead of their use (as launcher/data/prefetch.py)."""
    side = torch.cuda.Stream(device) if device.type == "cuda" else None
    queue: list = []
    it = iter(loader)

    def push() -> bool:
        try:
            batch = next(it)
        except StopIteration:
            return False
        if side is None:
            queue.append((transfer(to_device(batch, device)), None))
            return True
        with torch.cuda.stream(side):
            out = transfer(to_device(batch, device))
            ready = torch.cuda.Event()
            ready.record(side)
        queue.append((out, ready))
        return True

    for _ in range(depth):
        push()
    while queue:
        out, ready = queue.pop(0)
        if ready is not None:
            torch.cuda.current_stream(device).wait_event(ready)
            for t in out:
                if isinstance(t, torch.Tensor):
                    t.record_stream(torch.cuda.current_stream(device))
        push()
        yield out


def measure_loader(what: str, loader, transfer, step: Step | None, args, device: torch.device,
                   launchers: bool = False) -> dict:
    """img/s of `step` fed by `loader`; `launchers`: through the launcher's own CudaPrefetcher, which issues
    the copies and `transfer` (the recipe's on_after_batch_transfer) from a thread of its own, as a run does."""
    from launcher.data.prefetch import CudaPrefetcher

    skip = max(2 * args.workers, args.warmup)
    done, images, start = 0, 0, None
    batches = (CudaPrefetcher(loader, device, depth=2, after=transfer, threaded=True) if launchers
               else fed(loader, transfer, device))
    for x, y in batches:
        if step is not None:
            step(x, y)
        elif device.type == "cuda":
            x.sum()  # (the batch used: its side-stream work joins the default stream)
        done += 1
        if done == skip:
            sync(device)
            start = time.perf_counter()
        elif done > skip:
            images += len(y)
            if done - skip >= args.steps:
                break
    sync(device)
    if start is None or images == 0:
        return {"what": what, "error": f"too few batches: raise --n (needs {skip + args.steps} batches)"}
    seconds = time.perf_counter() - start
    return {"what": what, "img_per_s": round(images / seconds, 1), "steps": done - skip}


def loader_for(dataset, args, collate, device: torch.device):
    g = torch.Generator().manual_seed(0)
    return torch.utils.data.DataLoader(
        dataset, batch_size=args.batch, shuffle=True, generator=g, drop_last=True, num_workers=args.workers,
        pin_memory=device.type == "cuda", collate_fn=collate, prefetch_factor=4 if args.workers else None,
        persistent_workers=False)


def baseline(args, device: torch.device):
    from torchvision import datasets
    from torchvision.transforms import v2

    from launcher.data.images import MEAN, STD

    tf = v2.Compose([v2.RandomResizedCrop(args.size, antialias=True), v2.RandomHorizontalFlip(), v2.ToImage(),
                     v2.ToDtype(torch.float32, scale=True),
                     v2.Normalize([m / 255 for m in MEAN], [s / 255 for s in STD])])
    ds = datasets.ImageFolder(str(Path(args.root) / "train"), transform=tf)

    def transfer(batch):
        x, y = batch
        return (x.contiguous(memory_format=torch.channels_last) if device.type == "cuda" else x), y

    return loader_for(ds, args, None, device), transfer


def recipe_path(args, mode: str, device: torch.device):
    """recipe=imagefolder's train Dataset for data.decode=mode, its collate and its on_after_batch_transfer.
    mode gpu/auto: the GPU decoder the recipe picks (nvImageCodec's hardware decoder where installed);
    gpu-nvjpeg/auto-nvjpeg: torchvision's nvJPEG whatever is installed. On the CPU (--device cpu) gpu and auto
    still run the GPU path's code (nvJPEG's place taken by the CPU decoder)."""
    from launcher.data import gpu_decode
    from launcher.data.folders import scan
    from launcher.data.images import ImageFolderSplit
    from launcher.host.compose import config_for
    from launcher.recipes.imagefolder import ImageFolder

    decode, _, decoder = mode.partition("-")
    gpu_decode._hardware.clear()
    if decoder == "nvjpeg":
        gpu_decode._hardware[device] = None
    hardware = gpu_decode.hardware_decoder(device) is not None
    cfg = config_for("recipe=imagefolder", f"data.root={args.root}", f"recipe.model={args.model}",
                     f"recipe.image_size={args.size}", f"data.decode={decode}", f"data.workers={args.workers}",
                     f"perf.channels_last={device.type == 'cuda'}")
    recipe = ImageFolder(cfg)
    share = {"cpu": 0.0, "gpu": 1.0, "auto": args.gpu_share}[decode]
    folders = scan(Path(args.root))
    regions = decode != "cpu" and device.type == "cuda" and gpu_decode.resizes_on_gpu()  # (as the recipe's load)
    ds = ImageFolderSplit(folders["train"], train=True, image_size=args.size, eval_resize=cfg.recipe.eval_side,
                          min_scale=cfg.recipe.min_scale, gpu_share=share, regions=regions)
    if regions:  # the workers' crops resized on the GPU, their batches through the recipe's shared slots
        ds.slots = recipe._slots = recipe.batch_slots()
    ds.set_epoch(0)
    return (loader_for(ds, args, recipe.collate, device), lambda b: recipe.on_after_batch_transfer(b, True), share,
            "nvimgcodec" if hardware and decode != "cpu" else "nvjpeg" if decode != "cpu" else "pil")


# ---- main -------------------------------------------------------------------------------------------------


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", default=os.path.expanduser("~/.cache/launcher/bench-imagefolder"))
    p.add_argument("--n", type=int, default=20_000)
    p.add_argument("--classes", type=int, default=100)
    p.add_argument("--device", default="cuda")
    p.add_argument("--model", default="resnet50")
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--workers", type=int, default=15)
    p.add_argument("--steps", type=int, default=30, help="timed steps (batches) per measurement")
    p.add_argument("--warmup", type=int, default=10, help="untimed steps first (compiling happens there)")
    p.add_argument("--busy", type=int, nargs="*", default=[],
                   help="the limit again with N processes decoding JPEGs beside it (one row per N and nice)")
    p.add_argument("--gpu-share", type=float, default=0.25, help="auto rows: the share of each batch for the GPU")
    p.add_argument("--busy-nice", type=int, nargs="*", default=[0])
    p.add_argument("--no-compile", dest="compile", action="store_false")
    p.add_argument("--no-feed", dest="feed", action="store_false", help="skip the data paths measured alone")
    p.add_argument("--only", default="limit,baseline,cpu,gpu,auto,gpu-nvjpeg,auto-nvjpeg",
                   help="which rows, comma-separated (gpu/auto: nvImageCodec where installed; *-nvjpeg: torchvision's)")
    args = p.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    make_folder(Path(args.root), args.n, args.classes)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    info = {"torch": torch.__version__, "device": name,
            "cores": len(os.sched_getaffinity(0)), "model": args.model, "size": args.size, "batch": args.batch,
            "workers": args.workers, "compile": args.compile}
    print(json.dumps(info), flush=True)
    step = Step(args, args.classes, device)
    rows = []
    only = args.only.split(",")

    def emit(row: dict) -> None:
        rows.append(row)
        print(json.dumps(row), flush=True)

    if "limit" in only:
        emit(measure_limit(args, step, device))
    for n in args.busy:
        for nice in args.busy_nice:
            emit({**measure_limit(args, step, device, n, nice), "what": f"limit-busy{n}-nice{nice}"})
    if "baseline" in only:
        loader, transfer = baseline(args, device)
        emit(measure_loader("baseline", loader, transfer, step, args, device))
    for mode in [m for m in only if m.split("-")[0] in ("cpu", "gpu", "auto")]:
        loader, transfer, share, decoder = recipe_path(args, mode, device)
        row = measure_loader(f"decode={mode}", loader, transfer, step, args, device, launchers=True)
        emit({**row, "gpu_share": round(share, 3), "decoder": decoder})
        if args.feed:
            loader, transfer, share, decoder = recipe_path(args, mode, device)
            emit({**measure_loader(f"decode={mode}-feed", loader, transfer, None, args, device, launchers=True),
                  "gpu_share": round(share, 3), "decoder": decoder})
    if args.feed and "baseline" in only:
        loader, transfer = baseline(args, device)
        emit(measure_loader("baseline-feed", loader, transfer, None, args, device))
    limit = next((r["img_per_s"] for r in rows if r["what"] == "limit"), None)
    print(f"\n{'what':<22}{'img/s':>10}{'of limit':>10}")
    for r in rows:
        rate = r.get("img_per_s")
        share = f"{rate / limit:.0%}" if rate and limit else ""
        print(f"{r['what']:<22}{(f'{rate:,.0f}' if rate else r.get('error', '')):>10}{share:>10}")



if __name__ == "__main__":
    main()
