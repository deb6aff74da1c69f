"""The baselines `launch` is measured against: a plain DDP training script started by torchrun.

    torchrun --standalone --nproc-per-node=2 bench/torchrun_ddp.py --model resnet18 --batch-per-gpu 512
    torchrun --standalone --nproc-per-node=2 bench/torchrun_ddp.py --model resnet18 --compile reduce-overhead
    torchrun --standalone --nproc-per-node=2 bench/torchrun_ddp.py --startup-only

Written the way a skilled user would write it, doing the same work as `launch recipe=cifar10`:
GPU-resident CIFAR-shaped uint8 data, each step's rows gathered on the GPU, a random left-right flip and
a random shift of up to 2 pixels (reflect padding) per image on the GPU, normalization, bf16 autocast,
channels_last, cross-entropy with label smoothing 0.2, fused SGD with Nesterov momentum and weight
decay, DDP with gradient_as_bucket_view, cuDNN autotuning, no host sync inside an epoch. It uses the
launcher's network definitions (recipes/vision_models.py) so only the launching and the loop differ.

`--compile MODE` (default, reduce-overhead, max-autotune-no-cudagraphs) compiles the DDP module
(dynamo splits its graph at DDP's buckets, so the all-reduce still overlaps the backward pass; with
reduce-overhead each piece is a CUDA graph) and the input pipeline (gather, augmentation,
normalization) as its own compiled function. `--no-augment` leaves augmentation out.

Rank 0 prints one JSON line: img/s over the epochs after the first (device clock, the slowest rank),
wall-clock img/s over the same epochs, and (with BENCH_T0 set to the time.time() the command started)
seconds to the first step. `--startup-only` initializes NCCL, all-reduces one tensor and reports when.
"""

from __future__ import annotations

import argparse
import json
import os
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--batch-per-gpu", type=int, default=512)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--compile", default="none",
                        choices=["none", "default", "reduce-overhead", "max-autotune-no-cudagraphs"])
    parser.add_argument("--no-augment", action="store_true")
    parser.add_argument("--startup-only", action="store_true")
    args = parser.parse_args()
    t0 = float(os.environ.get("BENCH_T0", time.time()))

    import torch
    import torch.distributed as dist

    rank, local_rank, world = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    dist.init_process_group("nccl", device_id=device)
    if args.startup_only:
        t = torch.ones(1, device=device)
        dist.all_reduce(t)
        torch.cuda.synchronize()
        if rank == 0:
            print(json.dumps({"what": "torchrun_startup", "world_size": world, "first_allreduce_s":
                              round(time.time() - t0, 2), "torch": torch.__version__}), flush=True)
        dist.destroy_process_group()
        return

    from launcher.recipes.cifar10 import MEAN, STD
    from launcher.recipes.vision_models import MODELS

    torch.backends.cudnn.benchmark = True
    n = 50_000
    g = torch.Generator(device=device).manual_seed(0)
    images = torch.randint(0, 256, (n, 3, 32, 32), dtype=torch.uint8, device=device, generator=g)
    labels = torch.randint(0, 10, (n,), device=device, generator=g)
    mean = torch.tensor(MEAN, device=device).view(1, -1, 1, 1)
    std = torch.tensor(STD, device=device).view(1, -1, 1, 1)
    torch.manual_seed(0)
    model = MODELS[args.model](10).to(device).to(memory_format=torch.channels_last)
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[local_rank], gradient_as_bucket_view=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=5e-4, fused=True)
    loss_fn = torch.nn.CrossEntropyLoss(label_smoothing=0.2)
    augment = not args.no_augment
    shift = 2
    rows = torch.arange(32, device=device)

    def inputs(idx: torch.Tensor) -> torch.Tensor:
        x = images[idx]
        if augment:  # a random flip, then a random shift by up to 2 pixels with reflect padding
            b = x.shape[0]
            flip = torch.rand(b, device=device) < 0.5
            x = torch.where(flip.view(-1, 1, 1, 1), x.flip(3), x)
            padded = torch.nn.functional.pad(x.float(), (shift,) * 4, mode="reflect")
            dy = torch.randint(0, 2 * shift + 1, (b, 1), device=device)
            dx = torch.randint(0, 2 * shift + 1, (b, 1), device=device)
            r = (dy + rows).view(b, 1, 32, 1)
            c = (dx + rows).view(b, 1, 1, 32)
            x = padded[torch.arange(b, device=device).view(b, 1, 1, 1), torch.arange(3, device=device).view(1, 3, 1, 1),
                       r, c]
        return ((x.float() - mean) / std).contiguous(memory_format=torch.channels_last)

    net = ddp
    if args.compile != "none":
        mode = None if args.compile == "default" else args.compile
        net = torch.compile(ddp, mode=mode)
        # the input pipeline is its own graph: gathers, random draws and normalization fused
        inputs = torch.compile(inputs, mode="max-autotune-no-cudagraphs" if mode == "max-autotune-no-cudagraphs"
                               else None)
    b = args.batch_per_gpu
    steps = n // (b * world)
    speeds, wall_starts, first_step_s = [], [], None
    for epoch in range(args.epochs):
        perm = torch.randperm(n, device=device, generator=torch.Generator(device=device).manual_seed(epoch))
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        dist.barrier()
        wall_starts.append(time.perf_counter())
        start.record()
        for step in range(steps):
            idx = perm[(step * world + rank) * b:(step * world + rank + 1) * b]
            x = inputs(idx)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = loss_fn(net(x), labels[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if first_step_s is None:
                torch.cuda.synchronize()
                first_step_s = time.time() - t0
        end.record()
        end.synchronize()
        seconds = torch.tensor(start.elapsed_time(end) / 1000, device=device)
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
        speeds.append(steps * b * world / seconds.item())
    torch.cuda.synchronize()
    dist.barrier()
    wall_starts.append(time.perf_counter())
    if rank == 0:
        steady = speeds[1:] or speeds
        wall = (wall_starts[-1] - wall_starts[1]) if len(wall_starts) > 2 else None
        print(json.dumps({"what": "torchrun_ddp", "model": args.model, "world_size": world, "batch_per_gpu": b,
                          "compile": args.compile, "augment": augment,
                          "img_per_s": round(sum(steady) / len(steady)),
                          "wall_img_per_s": round(steps * b * world * (len(wall_starts) - 2) / wall) if wall else None,
                          "first_step_s": round(first_step_s, 2),
                          "device": torch.cuda.get_device_name(device), "torch": torch.__version__}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
