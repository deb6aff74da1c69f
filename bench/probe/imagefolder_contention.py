"""Where recipe=imagefolder's GPU data path loses training speed: one process, one GPU, JSON lines.

    python bench/probe/imagefolder_contention.py --root /tmp/imagenet-gen --n 20000

Rows (each: img/s, and for data rows the host seconds per batch spent in each part, by thread):
  limit / limit-busy          the compiled step on a batch already on the GPU; then with a pure-Python thread
                              spinning beside it (what the GIL alone costs the step's kernel launches)
  decode-split-N              the hardware decoder alone, a batch split between N decoders in N threads
  limit-graph / -graph-busy   the same step compiled with mode="reduce-overhead" (replayed as CUDA graphs)
  gpu[-graph]                 data.decode=gpu through the launcher's threaded CudaPrefetcher, the step as above
  gpu-feed                    that data path alone, with the GPU time of decode and crops (CUDA events)
  auto-graph                  data.decode=auto, graph step
  baseline                    torchvision ImageFolder + DataLoader (the same call's reference)
  gil                         how much of the GIL a spinning thread gets while the hardware decoder decodes in
                              another thread (1.0: the decoder releases the GIL)
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import imagefolder as bench  # noqa: E402  (bench/imagefolder.py)

HOST: dict[str, float] = defaultdict(float)
GPU_EVENTS: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
TIME_GPU = False


def timed(name: str, fn):
    def wrapper(*a, **k):
        start = time.perf_counter()
        if TIME_GPU:
            e0 = torch.cuda.Event(enable_timing=True)
            e0.record()
        try:
            return fn(*a, **k)
        finally:
            if TIME_GPU:
                e1 = torch.cuda.Event(enable_timing=True)
                e1.record()
                GPU_EVENTS.append((name, e0, e1))
            HOST[f"{threading.current_thread().name}:{name}"] += time.perf_counter() - start
    return wrapper


def instrument() -> None:
    from launcher.recipes import imagefolder
    from launcher.train import prefetch

    imagefolder.decode_jpegs = timed("decode", imagefolder.decode_jpegs)
    imagefolder.crop_resize = timed("crop", imagefolder.crop_resize)
    from launcher.recipes import image_kernels

    image_kernels.crop_resize_normalize = timed("kernel", image_kernels.crop_resize_normalize)
    imagefolder.Normalizer.__call__ = timed("normalize", imagefolder.Normalizer.__call__)
    imagefolder.gpu_batch = timed("gpu_batch", imagefolder.gpu_batch)
    prefetch.to_device = timed("to_device", prefetch.to_device)


class Spinner:
    """A pure-Python thread that spins; `rate()`: its loops per second."""

    def __init__(self):
        self.count, self.stop = 0, threading.Event()
        self.thread = threading.Thread(target=self.run, name="spinner", daemon=True)

    def run(self):
        while not self.stop.is_set():
            for _ in range(1000):
                pass
            self.count += 1

    def __enter__(self):
        self.start = time.perf_counter()
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()
        self.seconds = time.perf_counter() - self.start

    def rate(self) -> float:
        return self.count / self.seconds


def spin_rate_alone(seconds: float = 1.0) -> float:
    with Spinner() as s:
        time.sleep(seconds)
    return s.rate()


def limit_row(args, step, device, what: str, busy: bool) -> dict:
    if busy:
        with Spinner():
            row = bench.measure_limit(args, step, device)
    else:
        row = bench.measure_limit(args, step, device)
    return {**row, "what": what}


def timed_batches(loader):
    """The DataLoader's batches, the wait for each counted (as "next", in the thread that takes them)."""
    it = iter(loader)
    while True:
        start = time.perf_counter()
        try:
            batch = next(it)
        except StopIteration:
            return
        HOST[f"{threading.current_thread().name}:next"] += time.perf_counter() - start
        yield batch


def data_row(args, step, device, mode: str, what: str) -> dict:
    HOST.clear()
    loader, transfer, share, decoder = bench.recipe_path(args, mode, device)
    loader = timed_batches(loader)
    feeds = step is None

    # the main thread's own parts
    def timed_step(x, y):
        t = time.perf_counter()
        step(x, y)
        HOST["main:step"] += time.perf_counter() - t

    start = time.perf_counter()
    row = bench.measure_loader(what, loader, transfer, None if feeds else timed_step, args, device, launchers=True)
    wall = time.perf_counter() - start
    batches = max(1, 2 * args.workers + args.steps)
    row.update(gpu_share=round(share, 3), decoder=decoder,
               host_ms_per_batch={k: round(1000 * v / batches, 2) for k, v in sorted(HOST.items())},
               wall_s=round(wall, 1))
    return row


def gpu_times(args, device, mode: str) -> dict:
    """The data path alone, each batch's parts timed on the side stream with CUDA events."""
    global TIME_GPU
    GPU_EVENTS.clear()
    TIME_GPU = True
    try:
        loader, transfer, _, _ = bench.recipe_path(args, mode, device)
        bench.measure_loader("gpu-times", loader, transfer, None, args, device, launchers=True)
    finally:
        TIME_GPU = False
    torch.cuda.synchronize(device)
    sums: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for name, e0, e1 in GPU_EVENTS:
        sums[name] += e0.elapsed_time(e1)
        counts[name] += 1
    return {"what": f"{mode}-gpu-ms-per-batch", **{k: round(sums[k] / counts[k], 2) for k in sums}}


def gil_row(args, device) -> dict:
    """A spinning thread's share of the GIL while another thread runs the hardware decoder back to back."""
    from launcher.recipes import imagefolder

    loader, _, _, decoder = bench.recipe_path(args, "gpu", device)
    batch = next(iter(loader))
    jpegs = batch[3].jpegs
    alone = spin_rate_alone()
    stop = threading.Event()
    decoded = [0]
    decode_s = [0.0]

    def decode_loop():
        torch.cuda.set_device(device)
        while not stop.is_set():
            t = time.perf_counter()
            imagefolder.decode_jpegs(jpegs, device, False)
            torch.cuda.synchronize(device)
            decode_s[0] += time.perf_counter() - t
            decoded[0] += len(jpegs)
            hw = imagefolder.hardware_decoder(device)
            if hw is not None:
                hw.release_after()

    t = threading.Thread(target=decode_loop, daemon=True)
    with Spinner() as s:
        t.start()
        time.sleep(3.0)
        stop.set()
        t.join()
    return {"what": "gil", "decoder": decoder, "spin_share_while_decoding": round(s.rate() / alone, 3),
            "decode_img_per_s_with_spinner": round(decoded[0] / max(decode_s[0], 1e-9), 1)}


def split_rows(args, device) -> list[dict]:
    """The hardware decoder alone on one batch's JPEGs: one call for the batch, or the batch split between 2
    and 4 decoders, each in its own thread on its own stream (img/s)."""
    from launcher.recipes import imagefolder

    loader, _, _, decoder = bench.recipe_path(args, "gpu", device)
    jpegs = next(iter(loader))[3].jpegs
    data = jpegs.data.numpy()
    arrays = [data[a:b] for a, b in zip(jpegs.offsets[:-1], jpegs.offsets[1:], strict=True)]
    rows = []
    for chunks in (1, 2, 4):
        decoders = [imagefolder.HardwareDecoder(device) for _ in range(chunks)]
        streams = [torch.cuda.Stream(device) for _ in range(chunks)]
        parts = [arrays[k::chunks] for k in range(chunks)]

        def work(k: int, reps: int, decoders=decoders, parts=parts, streams=streams) -> None:
            torch.cuda.set_device(device)
            d = decoders[k]
            for _ in range(reps):
                d.decoder.decode([d.nv.CodeStream(a) for a in parts[k]], params=d.params,
                                 cuda_stream=streams[k].cuda_stream)
                streams[k].synchronize()

        for k in range(chunks):
            work(k, 1)
        threads = [threading.Thread(target=work, args=(k, 8)) for k in range(chunks)]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        rows.append({"what": f"decode-split-{chunks}", "decoder": decoder,
                     "img_per_s": round(8 * len(arrays) / (time.perf_counter() - start), 1)})
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", default="/tmp/imagenet-gen")
    p.add_argument("--n", type=int, default=20_000)
    p.add_argument("--classes", type=int, default=100)
    p.add_argument("--model", default="resnet50")
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--workers", type=int, default=15)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--only", default="gpu-feed,split,limit,gpu,auto,baseline")
    p.add_argument("--device", default="cuda")
    p.add_argument("--no-compile", dest="compile", action="store_false")
    args = p.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    cuda = device.type == "cuda"
    torch.backends.cudnn.benchmark = True
    bench.make_folder(Path(args.root), args.n, args.classes)
    only = args.only.split(",")
    print(json.dumps({"torch": torch.__version__, "device": torch.cuda.get_device_name(device) if cuda else "cpu",
                      "spin_rate_alone": round(spin_rate_alone(), 1)}), flush=True)
    instrument()

    def emit(row):
        print(json.dumps(row), flush=True)

    if "gil" in only and cuda:
        emit(gil_row(args, device))
    if "gpu-feed" in only:
        emit(data_row(args, None, device, "gpu", "gpu-feed"))
        if cuda:
            emit(gpu_times(args, device, "gpu"))
    step = bench.Step(args, args.classes, device)
    if "split" in only and cuda:
        for row in split_rows(args, device):
            emit(row)
    if "limit" in only:
        emit(limit_row(args, step, device, "limit", False))
    if "busy" in only:
        emit(limit_row(args, step, device, "limit-busy", True))
    if "gpu" in only:
        emit(data_row(args, step, device, "gpu", "gpu"))
    if "auto" in only:
        emit(data_row(args, step, device, "auto", "auto"))
    if "baseline" in only:
        loader, transfer = bench.baseline(args, device)
        emit(bench.measure_loader("baseline", loader, transfer, step, args, device))
    if "graph" in only:
        graph = bench.Step(args, args.classes, device)
        if args.compile:
            graph.model = torch.compile(graph.model._orig_mod, mode="reduce-overhead")
        emit(limit_row(args, graph, device, "limit-graph", False))
        emit(limit_row(args, graph, device, "limit-graph-busy", True))
        emit(data_row(args, graph, device, "gpu", "gpu-graph"))
        emit(data_row(args, graph, device, "auto", "auto-graph"))
        emit(limit_row(args, step, device, "limit-again", False))


if __name__ == "__main__":
    main()
