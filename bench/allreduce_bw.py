"""What the GPUs' interconnect gives an all-reduce, as NCCL runs it (what DDP's gradient sync costs).

    python3 -m torch.distributed.run --standalone --nproc-per-node=2 bench/allreduce_bw.py
    NCCL_DEBUG=INFO ... (the transport NCCL chose: "via P2P/CUMEM", "via SHM", "NVLS")

One JSON line per size (rank 0): the mean time of an all-reduce over 20 (after 5 untimed), its algorithm
bandwidth (bytes / time) and bus bandwidth (algbw x 2(n-1)/n, nccl-tests' figure, comparable across world
sizes). A gradient all-reduce of GPT-2 124M in fp32 is ~500 MB, of ResNet-50 ~100 MB.
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist


def main() -> None:
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    n = dist.get_world_size()
    for megabytes in (1, 8, 25, 100, 250, 500):
        x = torch.ones(megabytes * 2**20 // 4, device="cuda")
        for _ in range(5):
            dist.all_reduce(x)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            dist.all_reduce(x)
        end.record()
        end.synchronize()
        seconds = start.elapsed_time(end) / 1000 / 20
        algbw = x.numel() * 4 / seconds / 1e9
        if dist.get_rank() == 0:
            print(json.dumps({"what": "all_reduce", "world_size": n, "megabytes": megabytes,
                              "ms": round(seconds * 1000, 3), "algbw_gb_s": round(algbw, 1),
                              "busbw_gb_s": round(algbw * 2 * (n - 1) / n, 1),
                              "device": torch.cuda.get_device_name(), "torch": torch.__version__}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
