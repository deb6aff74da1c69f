"""The baseline `launch` is measured against: a plain DDP training script started by torchrun.

    torchrun --standalone --nproc-per-node=2 bench/torchrun_ddp.py --model resnet18 --batch-per-gpu 512
    torchrun --standalone --nproc-per-node=2 bench/torchrun_ddp.py --startup-only

Written the way a careful user would: GPU-resident CIFAR-shaped uint8 data, normalization on the GPU,
bf16 autocast, channels_last, SGD with Nesterov momentum, DDP with gradient_as_bucket_view, no host
sync inside an epoch. It uses the same network definitions as the launcher (recipes/vision_models.py)
so only the launching and the loop differ. Rank 0 prints one JSON line: img/s over the epochs after
the first, and (with BENCH_T0 set to the time.time() the command started) seconds to the first step.
`--startup-only` initializes NCCL, all-reduces one tensor and reports when that finished.
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
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=5e-4)
    loss_fn = torch.nn.CrossEntropyLoss()
    b = args.batch_per_gpu
    steps = n // (b * world)
    speeds, first_step_s = [], None
    for epoch in range(args.epochs):
        perm = torch.randperm(n, device=device, generator=torch.Generator(device=device).manual_seed(epoch))
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for step in range(steps):
            idx = perm[(step * world + rank) * b:(step * world + rank + 1) * b]
            x = ((images[idx].float() - mean) / std).contiguous(memory_format=torch.channels_last)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = loss_fn(ddp(x), labels[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if first_step_s is None:
                torch.cuda.synchronize()
                first_step_s = time.time() - t0
        end.record()
        end.synchronize()
        speeds.append(steps * b * world / (start.elapsed_time(end) / 1000))
    if rank == 0:
        steady = speeds[1:] or speeds
        print(json.dumps({"what": "torchrun_ddp", "model": args.model, "world_size": world, "batch_per_gpu": b,
                          "img_per_s": round(sum(steady) / len(steady)), "first_step_s": round(first_step_s, 2),
                          "device": torch.cuda.get_device_name(device), "torch": torch.__version__}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
