"""Where an FSDP2 step of recipe=text's GPT spends its time on one GPU, against the plain model (issue 16).

    torchrun --standalone --nproc-per-node=1 bench/probe/fsdp_step.py [--layers 12 --width 768 ...]

Variants, each timed over `--steps` steps after a warm-up (device clock), one JSON line each: `plain`
(the model, bf16 autocast, fused AdamW), `fsdp` (fully_shard per block then the root, bf16 params / fp32
reduce, as strategy=fsdp does), `fsdp_foreach` (foreach AdamW), `fsdp_keep` (reshard_after_forward
False), `fsdp_noopt` (no optimizer step), `fsdp_noac` (no autocast: the
policy's bf16 weights alone), `*_compiled` (each block's forward compiled),
chosen by KINDS=a,b,..., and a torch.profiler table of the slowest one's top ops.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=20)
    a = p.parse_args()
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from launcher.recipes.text import GPT

    rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    x = torch.randint(0, 256, (a.batch, a.context + 1), device=device)

    def build(kind: str):
        torch.manual_seed(0)
        model = GPT(256, a.context, a.layers, a.width, a.heads, 0.0).to(device)
        if kind.startswith("fsdp"):
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            keep = kind != "fsdp_keep"
            for block in model.blocks:
                fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=keep)
            fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=keep)
        if "compiled" in kind:
            for block in model.blocks:
                block.forward = torch.compile(block.forward)
        fused = kind != "fsdp_foreach"
        opt = None if kind == "fsdp_noopt" else torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused or None,
                                                                    foreach=None if fused else True)
        return model, opt

    def step(model, opt, autocast=True):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            logits = model(x[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), x[:, 1:].flatten())
        loss.backward()
        if opt is not None:
            opt.step()
            opt.zero_grad(set_to_none=True)
        else:
            model.zero_grad(set_to_none=True)

    slowest = None
    kinds = os.environ.get("KINDS", "plain,fsdp,fsdp_foreach,fsdp_keep,fsdp_noopt").split(",")
    for kind in kinds:
        model, opt = build(kind)
        autocast = "noac" not in kind
        for _ in range(5):
            step(model, opt, autocast)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        import time

        t0 = time.perf_counter()
        start.record()
        for _ in range(a.steps):
            step(model, opt, autocast)
        host = time.perf_counter() - t0
        end.record()
        end.synchronize()
        ms = start.elapsed_time(end) / a.steps
        record = {"what": kind, "step_ms": round(ms, 2), "host_issue_ms": round(1000 * host / a.steps, 2),
                  "tokens_per_s": round(a.batch * a.context / ms * 1000), "device": torch.cuda.get_device_name(),
                  "torch": torch.__version__}
        print(json.dumps(record), flush=True)
        if slowest is None or ms > slowest[0]:
            slowest = (ms, kind, model, opt, autocast)
    _, kind, model, opt, autocast = slowest
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step(model, opt, autocast)
        torch.cuda.synchronize()
    print(f"profile of {kind}")
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25))
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
