"""Where an FSDP2 step of recipe=text's GPT spends its time, against the same model without FSDP (issues 16, 36).

    torchrun --standalone --nproc-per-node=2 bench/probe/fsdp_step.py [--vocab 50304 --layers 12 --width 768 ...]

Every variant trains as launch does (the loss inside the model's forward, bf16 autocast, fused AdamW,
gradients clipped at 1.0 unless said), timed over `--steps` steps after a warm-up on the device's clock,
one JSON line each from rank 0, chosen by KINDS=a,b,...:
  plain_c          the model compiled whole, no FSDP (each rank on its own: the GPU's work, no communication)
  fsdp_c           fully_shard per block then the root (bf16 weights, fp32 reduction), each block's forward
                   compiled, the root's eager (strategy=fsdp before the root was compiled)
  fsdp_cr          the same with the root's forward compiled too (its head and loss: strategy=fsdp now)
  fsdp_cr_nomp     ... without the mixed-precision policy (fp32 weights gathered, autocast casts them)
  fsdp_cr_keep     ... reshard_after_forward=False
  fsdp_cr_gN       ... N consecutive blocks to a unit (one FSDP2 group: one gather, one reduce-scatter)
  fsdp_whole       fully_shard on the root only (the whole model one unit) and its forward compiled whole
  fsdp_cr_noclip   ... without clipping
  *_dtclip         clipped through DTensor's dispatch (torch's clip on the sharded gradients: before 2026-11-27)
  fsdp             nothing compiled
A kind named twice runs twice (to see the spread between repeats). Each line also has the host's time a
step in the forward call, the backward call, the clipping and the optimizer's step (host-bound steps: the
queue never fills, so these are the host's own work).
PROFILE=kind prints torch.profiler's tables (self CPU, CUDA) for that kind, with its GPU busy time a step.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time

import torch
import torch.distributed as dist


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--vocab", type=int, default=50304)
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
    from launcher.train.step import clip_gradients

    rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    x = torch.randint(0, a.vocab, (a.batch, a.context + 1), device=device)

    def build(kind: str):
        torch.manual_seed(0)
        model = GPT(a.vocab, a.context, a.layers, a.width, a.heads, 0.0).to(device)
        if kind.startswith("fsdp"):
            policy = (MixedPrecisionPolicy() if "nomp" in kind
                      else MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
            keep = "keep" not in kind
            if not kind.startswith("fsdp_whole"):
                grouped = re.search(r"_g(\d+)", kind)
                per = int(grouped.group(1)) if grouped else 1
                blocks = list(model.blocks)
                for i in range(0, len(blocks), per):
                    unit = blocks[i:i + per]
                    fully_shard(unit if per > 1 else unit[0], mesh=mesh, mp_policy=policy,
                                reshard_after_forward=keep)
            fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=keep)
            if "_c" in kind:
                for block in model.blocks:
                    block.forward = torch.compile(block.forward)
            if "_cr" in kind or kind.startswith("fsdp_whole"):
                model.forward = torch.compile(model.forward)
        elif kind == "plain_c":
            model = torch.compile(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        return model, opt

    from launcher.train import step as steps

    sharded_group = steps._sharded_group
    parts = {"forward": 0.0, "backward": 0.0, "clip": 0.0, "optimizer": 0.0}

    def step(model, opt, clip: bool):
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss, _ = model(x[:, :-1], x[:, 1:])
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        if clip:
            clip_gradients(model, 1.0)
        t3 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t4 = time.perf_counter()
        for key, dt in zip(parts, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
            parts[key] += dt

    kinds = os.environ.get("KINDS", "plain_c,fsdp_c,fsdp_cr,fsdp_cr_nomp,fsdp_cr_keep,fsdp_cr_noclip").split(",")
    for kind in kinds:
        model, opt = build(kind)
        steps._sharded_group = (lambda grads: None) if "dtclip" in kind else sharded_group
        clip = "noclip" not in kind
        for _ in range(5):
            step(model, opt, clip)
        torch.cuda.synchronize()
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for key in parts:
            parts[key] = 0.0
        t0 = time.perf_counter()
        start.record()
        for _ in range(a.steps):
            step(model, opt, clip)
        host = time.perf_counter() - t0
        end.record()
        end.synchronize()
        ms = start.elapsed_time(end) / a.steps
        record = {"what": kind, "world": dist.get_world_size(), "step_ms": round(ms, 2),
                  "host_issue_ms": round(1000 * host / a.steps, 2),
                  "tokens_per_s_per_gpu": round(a.batch * a.context / ms * 1000),
                  **{f"host_{k}_ms": round(1000 * v / a.steps, 2) for k, v in parts.items()},
                  "max_mem_allocated_mb": round(torch.cuda.max_memory_allocated() / 2**20),
                  "device": torch.cuda.get_device_name(), "torch": torch.__version__}
        if rank == 0:
            print(json.dumps(record), flush=True)
        if os.environ.get("PROFILE") == kind:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    step(model, opt, clip)
                torch.cuda.synchronize()
            if rank == 0:
                events = prof.key_averages()
                busy = sum(e.self_device_time_total for e in events) / 3 / 1000
                print(json.dumps({"what": f"profile {kind}", "gpu_busy_ms_per_step": round(busy, 2)}), flush=True)
                print(events.table(sort_by="self_cpu_time_total", row_limit=30))
                print(events.table(sort_by="self_device_time_total", row_limit=15))
        del model, opt
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
