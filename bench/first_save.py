"""What fsdp's first sharded save holds the training thread for, with the host copy of the shards made ahead
(beside the first epoch, as a run does since dc01757) and without (made by the first save, as before): one
rank on gloo, a stack of linear layers sharded with FSDP2, AdamW's state made by a step, then one save through
the run's own writer (launcher/train/checkpoint.py, shard_writer.py) into a temporary folder.

    python bench/first_save.py                       # 24 layers of 4096 x 4096: 403M parameters, 4.8 GB of state
    python bench/first_save.py --layers 8 --repeat 3 # smaller, three times each

On a GPU machine pass --device cuda (one GPU; the host copy is then page-locked too). One JSON line per save:
{"host_copy_ahead", "device", "state_gb", "first_save_held_s"}.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def one(ahead: bool, layers: int, width: int, device_name: str) -> dict:
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from launcher.train import checkpoint
    from launcher.train.threads import Asides
    from launcher.world import WorldInfo

    device = torch.device(device_name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    folder = Path(tempfile.mkdtemp(prefix="first-save-"))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            store=dist.FileStore(str(folder / "store"), 1), rank=0, world_size=1)
    try:
        model = torch.nn.Sequential(*[torch.nn.Linear(width, width, device=device) for _ in range(layers)])
        for layer in model:
            fully_shard(layer)
        fully_shard(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        model(torch.randn(2, width, device=device)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        nets, steppers = SimpleNamespace(module=model), [SimpleNamespace(optimizer=optimizer)]
        world = WorldInfo(rank=0, local_rank=0, world_size=1, local_world_size=1, master_addr="127.0.0.1",
                          master_port=0)
        writer, strategy = checkpoint.BackgroundWriter(world), SimpleNamespace(options=None)
        try:
            if ahead:
                asides = Asides()
                checkpoint.make_shards_host_copy(strategy, nets, steppers, device, writer, asides)
                asides.wait()
            started = time.perf_counter()
            future = writer.shard_writer(strategy, device).save(checkpoint._dcp_state(nets, steppers),
                                                                folder / "epoch-1.dcp")
            held = time.perf_counter() - started
            future.result()
        finally:
            writer.close()
        state_gb = sum(p.numel() for p in model.parameters()) * 12 / 1e9  # (fp32 weights and 2 AdamW moments)
        return {"host_copy_ahead": ahead, "device": device.type, "state_gb": round(state_gb, 2),
                "first_save_held_s": round(held, 3)}
    finally:
        dist.destroy_process_group()
        shutil.rmtree(folder, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--one", choices=["ahead", "first"], help=argparse.SUPPRESS)  # (a child: one save)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.one == "ahead", args.layers, args.width, args.device)), flush=True)
        return
    for _ in range(args.repeat):  # (each save in a fresh process: nothing of one run's memory helps the next)
        for how in ("first", "ahead"):
            subprocess.run([sys.executable, __file__, "--one", how, "--layers", str(args.layers), "--width",
                            str(args.width), "--device", args.device], check=True)


if __name__ == "__main__":
    main()
