"""The baseline `launch recipe=text recipe.size=8b strategy=fsdp` is measured against (issue 60): a plain FSDP2
training script under torchrun, written as a skilled user writes one after torchtitan's recipe.

    torchrun --standalone --nproc-per-node=2 bench/llama_script.py --size 8b --context 8192 \
        --batch-per-gpu 2 --steps 20 --recompute selective

It trains the launcher's own Llama (recipes/text_models.py, Llama 3's shapes from launcher/config.py's
LLAMA_SIZES), so only the loop, the sharding code and the launching differ. What it does:
- the model built on the meta device and materialised shard by shard (`to_empty` on the GPU, then the
  model's own init on the shards), never whole on one GPU;
- each block its own FSDP2 unit, then the root (embedding, final norm, output layer), bf16 parameters and
  fp32 gradient reduction (MixedPrecisionPolicy), the shards freed after each unit's forward;
- activation checkpointing per block (`--recompute`): none, full, or selective (torch's selective
  checkpoint contexts keeping the outputs of matmuls and attention, the rest recomputed);
- torch.compile of each block around its checkpoint and of the loss (as torchtitan compiles both), fused
  AdamW (lr 3e-4, betas 0.9/0.95, weight decay 0.1) over the sharded parameters, gradient-norm clipping at 1.0;
- windows of random token ids drawn on the GPU each step (no data loading: the script's best case);
  the loss a float32 cross-entropy over every position (the output layer's matmul eager, before it).
Rank 0 prints one JSON line: tokens/s per GPU over the steps after `--warmup` (device clock, the slowest
rank), MFU from the model's FLOPs per token (6N + attention, as recipe=text counts it) against the GPU's
dense bf16 peak, peak memory allocated and reserved.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", default="8b", choices=["debug", "1b", "3b", "8b"])
    parser.add_argument("--vocab-size", type=int, default=128256)
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--batch-per-gpu", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20, help="timed steps")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (the compile among them)")
    parser.add_argument("--recompute", default="selective", choices=["none", "full", "selective"])
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="the GPU's dense bf16 peak (H100/H200)")
    args = parser.parse_args()

    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    from launcher.config import LLAMA_SIZES
    from recipes.text_models import Llama

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    shape = {k: v for k, v in LLAMA_SIZES[args.size].items() if k != "model"}
    vocab = -(-args.vocab_size // 64) * 64
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Llama(vocab, args.context, **shape)
    flops_per_token = model.flops_per_token()
    params = sum(p.numel() for p in model.parameters())

    costly = {torch.ops.aten.mm.default, torch.ops.aten._scaled_dot_product_flash_attention.default,
              torch.ops.aten._scaled_dot_product_cudnn_attention.default,
              torch.ops.aten._scaled_dot_product_efficient_attention.default}

    def keep(ctx, op, *a, **k):
        return CheckpointPolicy.MUST_SAVE if op in costly else CheckpointPolicy.PREFER_RECOMPUTE

    for block in model.blocks:  # checkpointed, then compiled around the checkpoint (torchtitan's order)
        forward = block.forward
        if args.recompute == "full":
            forward = functools.partial(checkpoint, forward, use_reentrant=False)
        elif args.recompute == "selective":
            forward = functools.partial(checkpoint, forward, use_reentrant=False,
                                        context_fn=functools.partial(create_selective_checkpoint_contexts, keep))
        block.forward = forward if args.no_compile else torch.compile(forward)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mp_policy=policy, reshard_after_forward=True)
    fully_shard(model, mp_policy=policy, reshard_after_forward=True)
    model.to_empty(device="cuda")
    torch.manual_seed(0)
    model.init_weights()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)

    generator = torch.Generator(device="cuda").manual_seed(1 + rank)

    def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    loss_of = cross_entropy if args.no_compile else torch.compile(cross_entropy)  # (as torchtitan compiles its loss)

    def step() -> torch.Tensor:
        tokens = torch.randint(0, args.vocab_size, (args.batch_per_gpu, args.context + 1), device="cuda",
                               generator=generator)
        loss = loss_of(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    started = time.perf_counter()
    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    warm_s = time.perf_counter() - started
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(args.steps):
        loss = step()
    end.record()
    torch.cuda.synchronize()
    seconds = torch.tensor(begin.elapsed_time(end) / 1000.0, device="cuda")
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    peak = torch.tensor([torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()], device="cuda",
                        dtype=torch.float64)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    per_gpu = args.steps * args.batch_per_gpu * args.context / seconds.item()
    if rank == 0:
        print(json.dumps({
            "run": "script", "size": args.size, "params": params, "gpus": world, "context": args.context,
            "batch_per_gpu": args.batch_per_gpu, "recompute": args.recompute, "compiled": not args.no_compile,
            "steps": args.steps, "step_s": seconds.item() / args.steps, "tokens_per_s_per_gpu": round(per_gpu),
            "mfu": per_gpu * flops_per_token / (args.peak_tflops * 1e12), "warmup_s": round(warm_s, 1),
            "loss": loss.item(), "peak_allocated_gib": peak[0].item() / 2**30,
            "peak_reserved_gib": peak[1].item() / 2**30, "gpu": torch.cuda.get_device_name(),
            "torch": torch.__version__}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
