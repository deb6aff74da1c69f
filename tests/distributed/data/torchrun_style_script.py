"""A plain torchrun-style script (reads RANK etc. from the environment), as a user would bring one."""

import argparse
import os
import sys

import torch
import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=1)
parser.add_argument("--name", default="x")
parser.add_argument("--fail-rank", type=int, default=-1)
parser.add_argument("--raise-rank", type=int, default=-1)  # raises while the other ranks wait in a collective
args = parser.parse_args()
dist.init_process_group("gloo")
rank = dist.get_rank()
total = torch.tensor([float(rank + 1)])
for _ in range(args.steps):
    dist.all_reduce(total)
if rank == args.raise_rank:
    raise ValueError(f"a bad batch on rank {rank}")
if args.raise_rank >= 0:
    dist.all_reduce(total)  # (the peer's death reaches the others here: gloo's "Connection closed by peer")
print(f"rank {rank} of {dist.get_world_size()} local {os.environ['LOCAL_RANK']} name={args.name} sum={total.item()}",
      flush=True)
# Leave the group before exiting, failing or not: a gloo group still alive at interpreter exit can
# abort the process (SIGABRT, "terminate called without an active exception") and hide the exit code.
dist.destroy_process_group()
if rank == args.fail_rank:
    sys.exit(3)
