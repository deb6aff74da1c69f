"""Does the host->GPU copy hide behind compute? Training img/s for each way of feeding one GPU.

    python bench/overlap.py                   # fast net @1024 and ResNet-18 @512, uint8 and float32 input

Input paths, each feeding the same training step (bf16 autocast, channels_last, SGD), all on
CIFAR-shaped data (50,000 x 3x32x32):
  resident     the whole set on the GPU, a batch is one gather there (launcher's data.placement=gpu)
  pageable     batch in ordinary host memory, `.cuda()` (the copy blocks the host)
  pinned       batch in pinned memory, `.cuda(non_blocking=True)` on the compute stream
  prefetcher   pinned batches through launcher.data.prefetch.CudaPrefetcher (side stream, 2 ahead)
  host_loader  launcher's whole data.placement=host path: a thread gathers rows into pinned memory,
               the prefetcher copies them
The pageable/pinned/prefetcher paths cycle through a pool of pre-gathered host batches, so they
differ only in how the copy is made. Input is uint8 pixels (normalized on the GPU) or float32
already normalized on the host (4x the bytes). Each cell prints one JSON line with img/s, its ratio
to `resident` for the same model and input, and the input-stall fraction launcher/train/stall.py measured.
Modes are measured in paired rounds (a short chunk of each mode per round, order rotated); a ratio is
the median over rounds of (mode / resident in the same round), with its interquartile range.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from launcher.data.placement import HostData, rank_order
from launcher.data.prefetch import CudaPrefetcher
from launcher.recipes.cifar10 import MEAN, STD, synthetic_splits
from launcher.recipes.vision_models import MODELS
from launcher.train.stall import StepClock

BATCH = {"airbench": 1024, "resnet18": 512}
MODES = ("resident", "pageable", "pinned", "prefetcher", "host_loader")
POOL = 16


class Bench:
    def __init__(self, model_name: str, batch: int, device: torch.device):
        torch.manual_seed(0)
        self.device = device
        self.model = MODELS[model_name](10).to(device).to(memory_format=torch.channels_last)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9, nesterov=True)
        self.loss_fn = torch.nn.CrossEntropyLoss()
        self.mean = torch.tensor(MEAN, device=device).view(1, -1, 1, 1)
        self.std = torch.tensor(STD, device=device).view(1, -1, 1, 1)
        self.batch = batch

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        if x.dtype == torch.uint8:
            x = (x.float() - self.mean) / self.std
        x = x.contiguous(memory_format=torch.channels_last)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = self.loss_fn(self.model(x), y)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()

    def run(self, batches, steps: int, warmup: int) -> tuple[float, float]:
        """img/s over `steps` steps after `warmup`, and the input-stall fraction of those steps."""
        it = iter(batches)
        for _ in range(warmup):
            x, y = next(it)[:2]
            self.step(x, y)
        torch.cuda.synchronize()
        clock = StepClock(self.device)
        clock.start()
        for _ in range(steps):
            x, y = next(it)[:2]
            clock.batch_ready()
            self.step(x, y)
            clock.step_end()
        timing = clock.finish()
        return steps * self.batch / timing.span_s, timing.stall_fraction


def cycle(pool, to_device):
    while True:
        for x, y in pool:
            yield to_device(x), to_device(y)


def endless(batches_fn):
    while True:
        yield from batches_fn()


def make_inputs(mode, data_x, data_y, gpu_x, gpu_y, batch, device, pools):
    n = len(data_y)
    if mode == "resident":
        def resident():
            order = torch.randperm(n, device=device)[: n // batch * batch].view(-1, batch)
            for idx in order:
                yield gpu_x[idx], gpu_y[idx]
        return endless(resident)
    if mode == "pageable":
        return cycle(pools["pageable"], lambda t: t.to(device))
    if mode == "pinned":
        return cycle(pools["pinned"], lambda t: t.to(device, non_blocking=True))
    if mode == "prefetcher":
        return iter(CudaPrefetcher(cycle(pools["pinned"], lambda t: t), device, depth=2))
    host = HostData(data_x, data_y, device, depth=2)
    epoch = iter(range(10**9))
    return endless(lambda: host.batches(rank_order(n, batch, 0, next(epoch))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(BATCH))
    parser.add_argument("--inputs", nargs="+", default=["uint8", "float32"])
    parser.add_argument("--steps", type=int, default=60, help="steps per mode per round")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    device = torch.device("cuda", 0)
    torch.backends.cudnn.benchmark = True
    splits = synthetic_splits(50_000, 10, seed=0)
    mean, std = torch.tensor(MEAN).view(1, -1, 1, 1), torch.tensor(STD).view(1, -1, 1, 1)
    for model_name in args.models:
        batch = BATCH.get(model_name, 512)
        bench = Bench(model_name, batch, device)
        for kind in args.inputs:
            x = splits.train_x if kind == "uint8" else ((splits.train_x.float() - mean) / std).contiguous()
            y = splits.train_y
            gpu_x, gpu_y = x.to(device), y.to(device)
            g = torch.Generator().manual_seed(1)
            rows = [torch.randint(0, len(y), (batch,), generator=g) for _ in range(POOL)]
            pageable = [(x[r], y[r]) for r in rows]
            pools = {"pageable": pageable, "pinned": [(a.pin_memory(), b.pin_memory()) for a, b in pageable]}
            # Paired rounds: every round runs a short chunk of each mode (rotated order), and each mode is
            # compared with `resident` of the same round, so drift in GPU clocks, temperature or host load
            # cancels out instead of landing on whichever mode ran at a bad moment.
            streams = {mode: make_inputs(mode, x, y, gpu_x, gpu_y, batch, device, pools) for mode in MODES}
            for mode in MODES:
                bench.run(streams[mode], 1, args.warmup)
            runs: dict[str, list[tuple[float, float]]] = {mode: [] for mode in MODES}
            for repeat in range(args.rounds):
                for mode in MODES[repeat % len(MODES):] + MODES[:repeat % len(MODES)]:
                    runs[mode].append(bench.run(streams[mode], args.steps, 3))
            for mode in MODES:
                speeds = [speed for speed, _ in runs[mode]]
                ratios = [a / b for (a, _), (b, _) in zip(runs[mode], runs["resident"], strict=True)]
                q1, _, q3 = statistics.quantiles(ratios, n=4)
                print(json.dumps({"model": model_name, "batch": batch, "input": kind, "mode": mode,
                                  "img_per_s": round(statistics.median(speeds)),
                                  "vs_resident": round(statistics.median(ratios), 3),
                                  "vs_resident_iqr": [round(q1, 3), round(q3, 3)],
                                  "input_stall": round(statistics.median(st for _, st in runs[mode]), 4),
                                  "steps": args.steps, "rounds": args.rounds,
                                  "device": torch.cuda.get_device_name(device), "torch": torch.__version__,
                                  "date": time.strftime("%Y-%m-%d")}), flush=True)
            del streams
            del gpu_x, gpu_y, pools
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
