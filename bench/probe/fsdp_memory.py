"""Where a rank's GPU memory goes under ddp and fsdp in a world of N ranks, measured on ONE GPU.

torch's "fake" process group (torch.testing._internal.distributed.fake_pg) lets rank 0 of a world of
`--world` ranks run alone: collectives return at once (the numbers are not trained ones), but every
allocation is the one rank 0 makes in that world: its shards, FSDP2's gathered blocks and
reduce-scatter buffers, DDP's buckets. The model, optimizer and step are the launcher's own
(recipes/text.py's GPT, launcher/strategies/fsdp.py's wrap, launcher/train/optim.py's fused AdamW,
bf16 autocast), so the figures say what `launch ... strategy=fsdp gpus=[0,1]` holds per GPU, phase by
phase, without a second GPU. One JSON line per strategy:

    bash bench/on_device.sh py bench/probe/fsdp_memory.py --layers 4 --width 1024 --heads 8 --context 128 \
        --batch-per-rank 4 --eval-per-rank 128
"""
import argparse
import json

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from launcher.config import AdamWConfig, FSDPConfig
from launcher.recipes.text import GPT, VOCAB, NextTokenLoss
from launcher.strategies.fsdp import FSDP
from launcher.train import optim

MB = 2**20


def mb(x: float) -> float:
    return round(x / MB, 1)


def _bucket_back(_state, bucket):
    done = torch.futures.Future()
    done.set_result(bucket.buffer())
    return done


def run(args: argparse.Namespace, strategy: str, mixed: bool) -> dict:
    device = torch.device("cuda", 0)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    row: dict = {"strategy": strategy, "world": args.world, "mixed_precision": mixed}
    torch.manual_seed(0)
    if strategy == "fsdp":
        fsdp = FSDP.__new__(FSDP)
        fsdp.options = FSDPConfig(mixed_precision=mixed, reshard_after_forward=not args.keep_gathered,
                                  min_unit_params=args.min_unit_params)
        fsdp.world_size = args.world
        with torch.device("meta"):
            model = GPT(VOCAB, args.context, args.layers, args.width, args.heads, 0.0)
        module = fsdp.wrap(model, device).module
    else:
        from torch.nn.parallel import DistributedDataParallel
        model = GPT(VOCAB, args.context, args.layers, args.width, args.heads, 0.0).to(device)
        module = DistributedDataParallel(model, device_ids=[0], gradient_as_bucket_view=True, bucket_cap_mb=25)
        # (the fake group's all-reduce gives DDP's reducer no tensor back; NCCL's reduces the bucket in place)
        module.register_comm_hook(None, _bucket_back)
    row["parameters_m"] = round(sum(p.numel() for p in model.parameters()) / 1e6, 2)
    row["after_wrap_mb"] = mb(torch.cuda.memory_allocated(device) - base)
    [stepper] = optim.build(AdamWConfig(), 1e-3, 1, model, 10, fused=True)
    loss_fn = NextTokenLoss()
    x = torch.randint(0, VOCAB, (args.batch_per_rank, args.context), device=device)
    for step in range(3):
        if step == 2:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(device)
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_fn(module(x), x)
        loss.backward()
        if step == 2:
            row["after_backward_mb"] = mb(torch.cuda.memory_allocated(device) - base)
        stepper.optimizer.step()
    torch.cuda.synchronize()
    row["train_step_peak_mb"] = mb(torch.cuda.max_memory_allocated(device) - base)
    row["after_step_mb"] = mb(torch.cuda.memory_allocated(device) - base)
    torch.cuda.reset_peak_memory_stats(device)
    xe = torch.randint(0, VOCAB, (args.eval_per_rank, args.context), device=device)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        loss_fn(module(xe), xe)
    torch.cuda.synchronize()
    row["eval_peak_mb"] = mb(torch.cuda.max_memory_allocated(device) - base)
    if strategy == "ddp":  # launch's rank 0 stages the checkpoint's weights and AdamW state on the GPU
        state = [p for p in model.parameters()] + [t for s in stepper.optimizer.state.values()
                                                   for t in s.values() if t.dim() > 0]
        row["checkpoint_staging_mb"] = mb(sum(t.numel() * t.element_size() for t in state))
    del module, model, stepper, x, xe, loss
    return row


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--batch-per-rank", type=int, default=4)
    p.add_argument("--eval-per-rank", type=int, default=128)
    p.add_argument("--runs", nargs="+", default=["ddp", "fsdp-fp32", "fsdp"],
                   help="ddp (bf16 autocast), fsdp-fp32 (strategy.mixed_precision=false), fsdp (bf16 policy)")
    p.add_argument("--keep-gathered", action="store_true", help="reshard_after_forward=false")
    p.add_argument("--min-unit-params", type=int, default=0,
                   help="strategy.min_unit_params (default 0: a block a unit, as the README's figures were measured)")
    args = p.parse_args()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.world)
    torch.cuda.set_device(0)
    shape = {k: getattr(args, k) for k in ("layers", "width", "heads", "context", "batch_per_rank", "eval_per_rank")}
    for name in args.runs:
        strategy, mixed = name.split("-")[0], not name.endswith("fp32")
        print(json.dumps({**shape, **run(args, strategy, mixed),
                          "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__}), flush=True)


if __name__ == "__main__":
    main()
