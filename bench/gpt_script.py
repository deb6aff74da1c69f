"""The baseline `launch recipe=text` is measured against: a plain nanoGPT-style training script under torchrun.

    torchrun --standalone --nproc-per-node=2 bench/gpt_script.py --stream TRAIN.bin --layers 12 --width 768 \
        --heads 12 --context 1024 --batch-per-gpu 16 --steps 60

Written the way a skilled user writes it: the byte stream memory-mapped and copied whole to the GPU,
each step's windows drawn at random positions and gathered there, bf16 autocast, fused AdamW, DDP with
gradient_as_bucket_view (when there are several ranks), gradient-norm clipping at 1.0 (nanoGPT's, and
recipe=text's), torch.compile of the DDP module, no host sync inside the timed steps. It trains the
launcher's own GPT (recipes/text.py), so only the loop and the launching differ. Rank 0 prints one JSON
line: tokens/s over the steps after `--warmup` (device clock, the slowest rank), MFU from the model's
FLOPs per token, peak memory. `--device cpu` runs it on gloo (a smoke test, no timing claims).
"""

from __future__ import annotations

import argparse
import json
import os
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stream", required=True, help="a uint8 token file (recipe=text's train.bin)")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--batch-per-gpu", type=int, default=16)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps first (--epochs 1 only)")
    parser.add_argument("--epochs", type=int, default=1, help="timed windows of --steps; the first is untimed if > 1")
    parser.add_argument("--lr", type=float, default=6e-4)
    parser.add_argument("--clip", type=float, default=1.0,
                        help="gradient-norm clipping, as nanoGPT and recipe=text (optim.clip_grad_norm); 0: none")
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = parser.parse_args()

    import numpy as np
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from launcher.recipes.text import GPT, peak_flops

    rank, local_rank = int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    cuda = args.device == "cuda"
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
        torch.set_float32_matmul_precision("high")
    if world > 1:
        dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    stream = torch.from_numpy(np.array(np.memmap(args.stream, dtype=np.uint8, mode="r"))).to(device)
    torch.manual_seed(0)
    model = GPT(256, args.context, args.layers, args.width, args.heads, 0.0).to(device)
    flops_per_token = model.flops_per_token()
    net: torch.nn.Module = model
    if world > 1:
        net = torch.nn.parallel.DistributedDataParallel(model, device_ids=[local_rank] if cuda else None,
                                                        gradient_as_bucket_view=True)
    if not args.no_compile:
        net = torch.compile(net)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, fused=cuda)
    offsets = torch.arange(args.context + 1, device=device)
    g = torch.Generator(device=device).manual_seed(1000 + rank)
    b, t = args.batch_per_gpu, args.context

    def step() -> torch.Tensor:
        starts = torch.randint(0, len(stream) - t - 1, (b,), device=device, generator=g)
        w = stream[starts[:, None] + offsets].long()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            logits = net(w[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), w[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if args.clip > 0:  # (no host sync: the norm stays on the device)
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip, foreach=True)
        opt.step()
        return loss.detach()

    def window(steps: int) -> float:
        """Seconds of `steps` steps, the device clock (no host sync inside)."""
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        for _ in range(steps):
            loss = step()
        if cuda:
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1000
        else:
            seconds = time.perf_counter() - t0
        span = torch.tensor(seconds, device=device)
        if world > 1:
            dist.all_reduce(span, op=dist.ReduceOp.MAX)
        window.loss = loss
        return span.item()

    if args.epochs > 1:
        spans = [window(args.steps)]  # holds compilation
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        timed = [window(args.steps) for _ in range(args.epochs - 1)]
        spans += timed
    else:
        for _ in range(args.warmup):  # compile, autotune, allocator
            step()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(device)
        spans = timed = [window(args.steps)]
    loss = window.loss
    per_window = [round(args.steps * b * t * world / s) for s in spans]
    tokens_per_s = sum(per_window[len(spans) - len(timed):]) / len(timed)
    peak = peak_flops(device)
    if rank == 0:
        print(json.dumps({
            "what": "gpt_script", "world_size": world, "layers": args.layers, "width": args.width,
            "heads": args.heads, "context": t, "batch_per_gpu": b, "compiled": not args.no_compile,
            "parameters": sum(p.numel() for p in model.parameters()), "flops_per_token": flops_per_token,
            "tokens_per_s": round(tokens_per_s), "mfu": round(tokens_per_s * flops_per_token / (peak * world), 4)
            if peak else None, "loss": round(loss.item(), 4), "per_window": per_window,
            "max_mem_allocated_mb": round(torch.cuda.max_memory_allocated(device) / 2**20) if cuda else None,
            "device": torch.cuda.get_device_name(device) if cuda else "cpu", "torch": torch.__version__}), flush=True)
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
