"""The baseline `launch recipe=text` is measured against: a plain nanoGPT-style training script under torchrun.

    torchrun --standalone --nproc-per-node=2 bench/gpt_script.py --stream TRAIN.bin --layers 12 --width 768 \
        --heads 12 --context 1024 --batch-per-gpu 16 --steps 60

GPT-2 124M on token shards (llm.c's or nanoGPT's uint16 .bin, or .npy; bench/make_token_shards.py writes
generated ones): 12 x 768, context 1024, vocabulary 50257 padded to 50304 (as nanoGPT and recipe=text do):

    python bench/make_token_shards.py /tmp/shards --shards 8 --tokens-per-shard 100000000
    torchrun --standalone --nproc-per-node=1 bench/gpt_script.py --shards '/tmp/shards/gen_*.bin' \
        --vocab-size 50257 --batch-per-gpu 16 --steps 60

Written the way a skilled user writes it: the byte stream memory-mapped and copied whole to the GPU,
each step's windows drawn at random positions and gathered there (with --shards: the training shards,
those whose names do not say `val`, copied end to end to the GPU, so they must fit in its memory; a
window is drawn among all shards' windows and never crosses a shard's end, as in recipe=text), bf16
autocast, fused AdamW, DDP with gradient_as_bucket_view (when there are several ranks), gradient-norm
clipping at 1.0 (nanoGPT's, and recipe=text's), torch.compile of the DDP module, no host sync inside the
timed steps. It trains the launcher's own GPT (recipes/text.py), so only the loop and the launching
differ. Rank 0 prints one JSON line: tokens/s over the steps after `--warmup` (device clock, the slowest
rank), MFU from the model's FLOPs per token, peak memory. `--device cpu` runs it on gloo (a smoke test,
no timing claims).
"""

from __future__ import annotations

import argparse
import json
import os
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    data = parser.add_mutually_exclusive_group(required=True)
    data.add_argument("--stream", help="a uint8 token file (recipe=text's train.bin)")
    data.add_argument("--shards", help="a glob of token shards (llm.c or nanoGPT .bin, .npy); `val` ones left out")
    parser.add_argument("--vocab-size", type=int, default=0,
                        help="the tokens' vocabulary (0: 256 for --stream, 50257 for --shards)")
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
    parser.add_argument("--compile-mode", default=None,
                        help="torch.compile's mode (default, max-autotune-no-cudagraphs, ...): a lever to measure")
    parser.add_argument("--sdpa", default="default", choices=["default", "cudnn", "flash", "efficient"],
                        help="the attention kernel scaled_dot_product_attention may use (default: torch's choice)")
    parser.add_argument("--bucket-mb", type=int, default=25, help="DDP's bucket_cap_mb (torch's default 25)")
    parser.add_argument("--static-graph", action="store_true", help="DDP(static_graph=True)")
    parser.add_argument("--ddp-hook", default="none", choices=["none", "bf16"],
                        help="bf16: gradients all-reduced in bf16 (torch's bf16_compress_hook; changes the numbers)")
    parser.add_argument("--no-optimize-ddp", action="store_true",
                        help="torch._dynamo.config.optimize_ddp=False: one compiled graph, no split at buckets")
    parser.add_argument("--loss", choices=["inside", "outside"], default="inside",
                        help="inside: the cross-entropy in the compiled module's forward (nanoGPT's model returns "
                             "its loss); outside: the logits returned, the loss eager after them")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = parser.parse_args()

    import numpy as np
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from launcher.data.token_shards import padded_vocab
    from launcher.recipes.text_models import GPT, peak_flops

    rank, local_rank = int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    cuda = args.device == "cuda"
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
        torch.set_float32_matmul_precision("high")
    if world > 1:
        dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    vocab = args.vocab_size or (50257 if args.shards else 256)
    b, t = args.batch_per_gpu, args.context
    mask = None
    if args.shards:
        stream, first, ends, bases = shards_on(args.shards, t, device)
        if cuda and stream.dtype in (torch.uint16, torch.uint32):  # CUDA indexes no unsigned 16/32-bit tensors
            mask = (1 << 8 * stream.element_size()) - 1
            stream = stream.view(torch.int16 if stream.dtype == torch.uint16 else torch.int32)
    else:
        stream = torch.from_numpy(np.array(np.memmap(args.stream, dtype=np.uint8, mode="r"))).to(device)
    torch.manual_seed(0)
    model = GPT(padded_vocab(vocab), args.context, args.layers, args.width, args.heads, 0.0).to(device)
    flops_per_token = model.flops_per_token()
    net: torch.nn.Module = model

    if args.loss == "inside":
        net = with_loss(model)
    if world > 1:
        net = torch.nn.parallel.DistributedDataParallel(net, device_ids=[local_rank] if cuda else None,
                                                        gradient_as_bucket_view=True, bucket_cap_mb=args.bucket_mb,
                                                        static_graph=args.static_graph)
        if args.ddp_hook == "bf16":
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook
            net.register_comm_hook(None, bf16_compress_hook)
    if args.no_optimize_ddp:
        torch._dynamo.config.optimize_ddp = False
    if not args.no_compile:
        net = torch.compile(net, mode=args.compile_mode)
    from contextlib import nullcontext

    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
               "efficient": SDPBackend.EFFICIENT_ATTENTION}.get(args.sdpa)
    attention = (lambda: sdpa_kernel([backend])) if backend is not None else nullcontext
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, fused=cuda)
    offsets = torch.arange(args.context + 1, device=device)
    g = torch.Generator(device=device).manual_seed(1000 + rank)

    def step() -> torch.Tensor:
        if args.shards:  # a window among every shard's, mapped to its shard (no host sync)
            idx = torch.randint(0, int(ends[-1]), (b,), device=device, generator=g)
            shard = torch.searchsorted(ends, idx, right=True)
            starts = bases[shard] + idx - first[shard]
        else:
            starts = torch.randint(0, len(stream) - t - 1, (b,), device=device, generator=g)
        w = stream[starts[:, None] + offsets].long()
        if mask is not None:
            w &= mask
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda), attention():
            if args.loss == "inside":
                loss = net(w[:, :-1], w[:, 1:])
            else:
                logits = net(w[:, :-1])
        if args.loss == "outside":
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
            "loss_where": args.loss, "compile_mode": args.compile_mode, "sdpa": args.sdpa,
            "bucket_mb": args.bucket_mb, "static_graph": args.static_graph, "ddp_hook": args.ddp_hook,
            "optimize_ddp": not args.no_optimize_ddp,
            "data": "shards" if args.shards else "stream", "data_tokens": len(stream), "vocab_size": vocab,
            "padded_vocab_size": padded_vocab(vocab),
            "parameters": sum(p.numel() for p in model.parameters()), "flops_per_token": flops_per_token,
            "tokens_per_s": round(tokens_per_s), "mfu": round(tokens_per_s * flops_per_token / (peak * world), 4)
            if peak else None, "loss": round(loss.item(), 4), "per_window": per_window,
            "max_mem_allocated_mb": round(torch.cuda.max_memory_allocated(device) / 2**20) if cuda else None,
            "device": torch.cuda.get_device_name(device) if cuda else "cpu", "torch": torch.__version__}), flush=True)
    if world > 1:
        dist.destroy_process_group()


def with_loss(model):
    """`model` with nanoGPT's forward(idx, targets): the logits, then the loss in fp32, in one graph."""
    import torch
    import torch.nn.functional as F

    class WithLoss(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, idx, targets):
            return F.cross_entropy(self.model(idx).flatten(0, 1).float(), targets.flatten())

    return WithLoss(model)


def shards_on(pattern: str, context: int, device):
    """The training shards `pattern` names (not those whose names say val) end to end in one tensor on
    `device`, and for drawing windows: each shard's first window number, the running window counts
    (window i lies in shard searchsorted(ends, i, right=True)) and each shard's start in the tensor."""
    import glob
    import warnings
    from pathlib import Path

    import numpy as np
    import torch

    from launcher.data.token_shards import is_held_out, read_shard

    shards = [read_shard(Path(p)) for p in sorted(glob.glob(pattern)) if not is_held_out(Path(p))]
    shards = [s for s in shards if s.tokens > context]
    if not shards:
        raise SystemExit(f"--shards {pattern}: no training shard (not named val) longer than --context {context}")
    dtype = {np.dtype(np.uint16): torch.uint16, np.dtype(np.uint32): torch.uint32}[shards[0].dtype]
    stream = torch.empty(sum(s.tokens for s in shards), dtype=dtype, device=device)
    bases, counts, base = [], [], 0
    for s in shards:  # each copied once, straight into its place
        with warnings.catch_warnings():  # (a read-only map; nothing writes to it)
            warnings.simplefilter("ignore", UserWarning)
            stream[base:base + s.tokens].copy_(torch.from_numpy(s.open()))
        bases.append(base)
        counts.append(s.tokens - context)  # window starts whose targets stay inside the shard
        base += s.tokens
    ends = torch.tensor(counts, device=device).cumsum(0)
    first = ends - torch.tensor(counts, device=device)
    return stream, first, ends, torch.tensor(bases, device=device)


if __name__ == "__main__":
    main()
