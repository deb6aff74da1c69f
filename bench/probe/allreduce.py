"""All-reduce time and bus bandwidth between the GPUs of one host (run under torchrun), JSON lines.

    python3 -m torch.distributed.run --standalone --nproc-per-node=2 bench/probe/allreduce.py [MB ...]
    NCCL_DEBUG=INFO ... (the transport NCCL chose: "via P2P/CUMEM", "via SHM", "NVLS")

Each size (default 1 8 45 128 MB; GPT-2 124M's fp32 gradients are ~500 MB, ResNet-50's ~100 MB) in fp32 and
bf16: the mean of 20 all-reduces after 5 untimed, and the bus bandwidth (nccl-tests' figure).
"""
import json
import os
import sys

import torch
import torch.distributed as dist

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
torch.cuda.set_device(rank)
dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
for mb in [int(x) for x in sys.argv[1:]] or [1, 8, 45, 128]:
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
                              "busbw_gb_s": round(busbw, 1), "device": torch.cuda.get_device_name(),
                              "torch": torch.__version__}), flush=True)
dist.destroy_process_group()
