"""Time to the first training step of `launch recipe=cifar10 gpus=[0,1]`, cold and warm (issue 15).

    python bench/first_step.py                 # needs 2 GPUs
    python bench/first_step.py --gpus [0] --warm-runs 3 --base /tmp/base --label-base cbd157a
                                               # one GPU; each warm run beside an older tree's (pip --target)

Each command runs twice in a row with a fresh launch cache (LAUNCH_CACHE_DIR: decoded data, inductor's
kernels) for the first of the two: the first run decodes (or generates) the data and fills the cache, the
second reads it. Two data paths: generated (data.synthetic=true) and the real loader on files in the
official CIFAR-10 python format (50,000 + 10,000 generated images written as data_batch_1..5 and
test_batch, since the device machine has no network). Python's own bytecode and the OS page cache are
warm for both runs of a pair; the first pair of the script also starts a process that has never run here.
One JSON line per run: seconds from the command starting to the first step's end, launch's itemized
timeline, and the whole command's wall time.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from launch_run import run_launch  # noqa: E402


def timed(label: str, overrides: list[str], env: dict[str, str], gpus: str = "[0,1]") -> dict:
    run = run_launch("recipe=cifar10", f"gpus={gpus}", *overrides, env=env)
    if not run.ok:
        return {"what": "first_step", "label": label, "exit_code": run.exit_code, "error": run.error_tail()}
    r = run.results
    return {"what": "first_step", "label": label, "first_step_s": run.first_step_from_command_s(),
            "startup": r["startup"], "wall_s": run.wall_s, "compiled": r.get("compiled"),
            "device": (r.get("devices") or ["?"])[0], "torch": r["torch"], "date": time.strftime("%Y-%m-%d")}


def main() -> None:
    import argparse

    from launcher.recipes.cifar10 import FOLDER, synthetic_splits, write_official_format

    parser = argparse.ArgumentParser()
    parser.add_argument("--gpus", default="[0,1]")
    parser.add_argument("--warm-runs", type=int, default=1)
    parser.add_argument("--base", default=None, help="an older tree of the launcher (pip install --target DIR)")
    parser.add_argument("--label-base", default="base")
    parser.add_argument("--extra", nargs="*", default=[], help="more overrides for every run (e.g. epochs=2)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="first-step-") as scratch:
        root = Path(scratch) / "cifar"
        write_official_format(root / FOLDER, synthetic_splits(50_000, 10_000, seed=1))
        for name, overrides in (("synthetic", ["data.synthetic=true", *args.extra]),
                                ("official format", [f"data.root={root}", *args.extra])):
            env = {**os.environ, "LAUNCH_CACHE_DIR": str(Path(scratch) / f"cache-{name.replace(' ', '-')}")}
            base_env = {**env, "PYTHONPATH": os.pathsep.join(filter(None, [args.base, env.get("PYTHONPATH")]))}
            attempts = ["cold cache", *["warm cache"] * args.warm_runs]
            for i, attempt in enumerate(attempts):
                print(json.dumps(timed(f"{name}, {attempt}", overrides, env, args.gpus)), flush=True)
                if args.base and i > 0:  # (the cache is the same: the older tree reads what the first run wrote)
                    row = timed(f"{name}, {attempt}, {args.label_base}", overrides, base_env, args.gpus)
                    print(json.dumps(row), flush=True)

if __name__ == "__main__":
    main()
