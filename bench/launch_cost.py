"""A small launch's own cost on a CPU machine: wall seconds and the machine's CPU seconds of a few launches, each
a fork of the tests' warm launcher (tests/warm.py), so that what is measured is the launch (Hydra, the plan,
elastic's agent and rendezvous, the workers, data, training, checkpoints, results, teardown), not the imports of
a fresh interpreter. Run it on an otherwise idle machine; CPU is read from /proc/stat (all cores).

    python bench/launch_cost.py                       # this checkout
    python bench/launch_cost.py --repo /tmp/old       # another tree (git worktree add /tmp/old <commit>)

One JSON line per launch: {"commit", "case", "wall_s", "cpu_s", "code"}.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TOY_TEXT = ("recipe=text", "gpus=[]", "recipe.layers=2", "recipe.width=32", "recipe.heads=2", "recipe.context=32",
            "recipe.max_bytes=100000", "progress=lines", "recipe.sample_bytes=20")
CASES = {
    "digits-ddp-1-epoch": ("recipe=digits", "gpus=[]", "strategy=ddp", "nprocs=2", "epochs=1"),
    "digits-single-1-epoch": ("recipe=digits", "gpus=[]", "epochs=1"),
    "digits-single-3-epochs": ("recipe=digits", "gpus=[]", "epochs=3"),
    "digits-dry-run": ("recipe=digits", "gpus=[]", "dry_run=true"),
    "text-ddp-1-epoch": (*TOY_TEXT, "strategy=ddp", "nprocs=2", "epochs=1"),
    "text-fsdp-2-epochs": (*TOY_TEXT, "strategy=fsdp", "nprocs=2", "epochs=2"),
}


def busy_jiffies() -> int:
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return sum(fields) - fields[3] - fields[4]  # all but idle and iowait


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", default=str(Path(__file__).resolve().parents[1]))
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--cases", default=",".join(CASES))
    args = parser.parse_args()
    repo = Path(args.repo).resolve()
    sys.path.insert(0, str(repo))
    from tests.conftest import clean_env
    from tests.warm import WarmLauncher

    commit = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    tick = os.sysconf("SC_CLK_TCK")
    warm = WarmLauncher()
    try:
        with tempfile.TemporaryDirectory() as scratch:
            cwd = Path(scratch)
            data = cwd / "data"
            data.mkdir()
            for i, name in enumerate(args.cases.split(",")):
                argv = [*CASES[name], f"data.root={data}"]
                warm.run([*argv, f"hydra.run.dir=first-{i}"], cwd, clean_env(), 600)  # (builds a corpus once)
                for k in range(args.repeat):
                    busy, start = busy_jiffies(), time.monotonic()
                    code, _, _ = warm.run([*argv, f"hydra.run.dir=run-{i}-{k}"], cwd, clean_env(), 600)
                    print(json.dumps({"commit": commit, "case": name, "wall_s": round(time.monotonic() - start, 2),
                                      "cpu_s": round((busy_jiffies() - busy) / tick, 2), "code": code}), flush=True)
    finally:
        warm.close()


if __name__ == "__main__":
    main()
