"""Where a GPT-2 124M training step spends its GPU time (issue 33's GPT target: what is there to win over
the nanoGPT-style script with the same work?).

    python3 bench/probe/gpt_profile.py [--batch 16] [--context 1024] [--steps 10]

The step is bench/gpt_script.py's (the launcher's GPT, its loss inside the compiled forward, bf16 autocast,
fused AdamW, clipping at 1.0) on random tokens of GPT-2's padded vocabulary. After warm-up, `--steps`
steps run under torch.profiler; each CUDA kernel's time is put in one class by its name (matrix products,
attention, the loss and logits' elementwise work, the optimizer, other fused elementwise work, copies).
Prints one JSON line: the step's device time, each class's milliseconds a step and share, and the 20
costliest kernels. The loss class is the most a fused linear + cross-entropy could save; the matrix
products' share, against their attainable rate, is what a faster GEMM could.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # (bench/: gpt_script's loss module)

CLASSES = [  # first match wins; names are CUDA kernels' as the profiler reports them
    ("attention", re.compile(r"flash|fmha|cudnn.*attn|attention|sdpa", re.I)),
    ("loss", re.compile(r"log_softmax|nll|cross_entropy|_softmax", re.I)),
    ("optimizer", re.compile(r"adam|multi_tensor|foreach|norm_.*clip|_amp_", re.I)),
    ("gemm", re.compile(r"gemm|nvjet|cutlass|sm\d+_xmma|ampere_|hopper|s16816|wgmma|cublas|mm_", re.I)),
    ("fused elementwise", re.compile(r"^triton_", re.I)),  # inductor's kernels: norms, GELU, residuals, casts
    ("copy", re.compile(r"memcpy|memset|copy|cat", re.I)),
    ("elementwise", re.compile(r"elementwise|vectorized|reduce", re.I)),
]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=15)
    parser.add_argument("--trace", default="", help="write the Chrome trace here too")
    args = parser.parse_args()

    import torch
    from gpt_script import with_loss
    from torch.profiler import ProfilerActivity, profile

    from launcher.recipes.text import GPT, peak_flops
    from launcher.recipes.token_shards import padded_vocab

    device = torch.device("cuda")
    torch.set_float32_matmul_precision("high")
    torch.manual_seed(0)
    vocab = padded_vocab(50257)
    model = GPT(vocab, args.context, 12, 768, 12, 0.0).to(device)

    net = torch.compile(with_loss(model))
    opt = torch.optim.AdamW(model.parameters(), lr=6e-4, weight_decay=0.01, fused=True)
    tokens = torch.randint(0, 50257, (args.batch, args.context + 1), device=device)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = net(tokens[:, :-1], tokens[:, 1:])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()

    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(args.steps):
        step()
    end.record()
    end.synchronize()
    step_ms = start.elapsed_time(end) / args.steps
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            step()
        torch.cuda.synchronize()
    if args.trace:
        prof.export_chrome_trace(args.trace)
    per_kernel: dict[str, float] = defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[event.name] += event.device_time_total / 1000 / args.steps  # ms a step
    per_class: dict[str, float] = defaultdict(float)
    for name, ms in per_kernel.items():
        cls = next((c for c, rx in CLASSES if rx.search(name)), "other")
        per_class[cls] += ms
    busy = sum(per_kernel.values())
    flops = model.flops_per_token() * args.batch * args.context
    print(json.dumps({
        "what": "gpt_profile", "batch": args.batch, "context": args.context, "step_ms": round(step_ms, 2),
        "kernels_ms": round(busy, 2), "tokens_per_s": round(args.batch * args.context / step_ms * 1000),
        "mfu": round(flops / (step_ms / 1000) / peak_flops(device), 4),
        "classes_ms": {c: round(ms, 2) for c, ms in sorted(per_class.items(), key=lambda kv: -kv[1])},
        "classes_share": {c: round(ms / busy, 3) for c, ms in sorted(per_class.items(), key=lambda kv: -kv[1])},
        "top": [[name[:90], round(ms, 3)] for name, ms in sorted(per_kernel.items(), key=lambda kv: -kv[1])[:20]],
        "device": torch.cuda.get_device_name(device), "torch": torch.__version__}), flush=True)


if __name__ == "__main__":
    main()
