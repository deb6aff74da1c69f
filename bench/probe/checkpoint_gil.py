"""What a sharded checkpoint written in the background takes from a host-bound training thread (issue 36).

    python -m torch.distributed.run --standalone --nproc-per-node=1 bench/probe/checkpoint_gil.py [--seconds 3]

strategy=fsdp saves through `dcp.async_save` (launcher/train/checkpoint.py `save_sharded`), whose writer
runs on a thread of the training process: where the step is partly the host's (FSDP2's hooks), the
writer's Python work shares the interpreter lock with it. This probe shards GPT-2 124M (FSDP2, AdamW
state) on the CPU, then counts a loop of tiny torch ops on the main thread (a stand-in for a host-bound
step) alone, while `dcp.async_save` writes with its default thread, and while it writes from a process
of its own (`AsyncCheckpointerType.PROCESS`). One JSON line: ops/s in each phase, the call's own time
(the state staged on the calling thread) and the save's whole time.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seconds", type=float, default=3.0)
    a = p.parse_args()
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from launcher.recipes.text import GPT

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    model = GPT(50304, 1024, 12, 768, 12, 0.0)
    fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, 50304, (1, 65))
    model(x[:, :-1], x[:, 1:])[0].backward()
    opt.step()
    group = dist.new_group(backend="gloo")
    one = torch.ones(4)

    def ops_per_s(seconds: float) -> int:
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            for _ in range(100):
                torch.add(one, one)
            n += 100
        return round(n / seconds)

    out = {"what": "checkpoint_gil", "world": dist.get_world_size(), "alone_ops_s": ops_per_s(a.seconds),
           "torch": torch.__version__}
    root = Path(tempfile.mkdtemp(prefix="checkpoint-gil-"))
    for name, kind in (("thread", AsyncCheckpointerType.THREAD), ("process", AsyncCheckpointerType.PROCESS)):
        model_state, optim_state = get_state_dict(model, opt)
        t0 = time.perf_counter()
        future = dcp.async_save({"model": model_state, "optim": optim_state}, checkpoint_id=root / name,
                                process_group=group, async_checkpointer_type=kind)
        call_s = time.perf_counter() - t0
        during = ops_per_s(a.seconds)
        still_writing = not future.done()
        future.result()
        out[name] = {"call_s": round(call_s, 3), "during_ops_s": during, "still_writing_after": still_writing,
                     "save_s": round(time.perf_counter() - t0, 2), "after_ops_s": ops_per_s(a.seconds)}
    shutil.rmtree(root, ignore_errors=True)
    if dist.get_rank() == 0:
        print(json.dumps(out), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
