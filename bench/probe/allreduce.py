"""All-reduce time and bus bandwidth between the GPUs of one host (run under torchrun), JSON lines."""
import json
import os

import torch
import torch.distributed as dist

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
torch.cuda.set_device(rank)
dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
for mb in (1, 8, 45, 128):
    for dtype in (torch.float32, torch.bfloat16):
        t = torch.ones(mb * 2**20 // torch.tensor([], dtype=dtype).element_size(), dtype=dtype, device="cuda")
        for _ in range(5):
            dist.all_reduce(t)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            dist.all_reduce(t)
        end.record()
        end.synchronize()
        ms = start.elapsed_time(end) / 20
        if rank == 0:
            busbw = mb * 2**20 * 2 * (world - 1) / world / (ms / 1000) / 1e9
            print(json.dumps({"what": "allreduce", "mb": mb, "dtype": str(dtype), "ms": round(ms, 3),
                              "busbw_gb_s": round(busbw, 1)}), flush=True)
dist.destroy_process_group()
