"""Time the record-speed CIFAR-10 configuration through `launch`, as a user runs it.

    python bench/fast_recipe.py --runs 3                         # 1 GPU, CIFAR-shaped synthetic data
    python bench/fast_recipe.py --runs 1 --gpus [0,1]            # DDP on 2 GPUs
    python bench/fast_recipe.py --runs 1 -- data.root=~/cifar    # real CIFAR-10 (accuracy means something)
    python bench/fast_recipe.py --base /tmp/base --label cab9a7a # another tree of the launcher (pip --target)

Each run is one `launch recipe=cifar10_fast ...` in a scratch directory. The figure that counts is
`train_eval_s` from results.json: training steps plus the final (test-time-augmented) evaluation,
timed with CUDA events, compile warm-up excluded, like the airbench records. One JSON line per run,
then a summary line (mean and min over runs).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from launch_run import run_launch  # noqa: E402


def one_run(gpus: str, extra: list[str], synthetic: bool, base: str | None = None) -> dict:
    env = None
    if base:  # the launcher installed under `base` comes first on the path
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [base, os.environ.get("PYTHONPATH")]))}
    run = run_launch("recipe=cifar10_fast", f"gpus={gpus}", *extra, *(["data.synthetic=true"] if synthetic else []),
                     env=env)
    if not run.ok:
        return {"exit_code": run.exit_code, "output_tail": run.output[-2000:]}
    r, wall = run.results, run.wall_s
    timed = r["timed"]
    return {
        "exit_code": 0, "gpus": gpus, "strategy": r["strategy"], "world_size": r["world_size"],
        "train_eval_s": round(timed["train_eval_s"], 4), "train_s": round(timed["train_s"], 4),
        "eval_s": round(timed["eval_s"], 4), "compile_warmup_s": round(timed["compile_warmup_s"] or 0, 1),
        "first_step_s": round(r["first_step_s"], 2), "wall_s": round(wall, 1), "test_acc": r["test_acc"],
        "synthetic_data": r["synthetic_data"], "epochs": r["epochs"], "batch_size": r["batch_size"],
        "input_stall": r["input_stall"], "data_placement": r["data_placement"], "device": r["devices"],
        "torch": r["torch"], "date": time.strftime("%Y-%m-%d"), "cuda_graph": r.get("cuda_graph"),
        "overrides": " ".join(extra),
        "per_epoch": [{k: row.get(k) for k in ("train_s", "host_issue_s", "input_stall")} for row in run.metrics],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--gpus", default="[0]")
    parser.add_argument("--real-data", action="store_true", help="use CIFAR-10 under data.root, not synthetic")
    parser.add_argument("--base", default=None, help="a directory holding another launcher tree, put first on the path")
    parser.add_argument("--label", default=None, help="a name for the tree measured (e.g. its commit)")
    parser.add_argument("overrides", nargs="*", help="extra launch overrides, after --")
    args = parser.parse_args()
    times = []
    for _ in range(args.runs):
        row = one_run(args.gpus, args.overrides, synthetic=not args.real_data, base=args.base)
        row["label"] = args.label
        print(json.dumps(row), flush=True)
        if row["exit_code"] == 0:
            times.append(row["train_eval_s"])
    if times:
        print(json.dumps({"summary": "train_eval_s", "runs": len(times), "mean": round(statistics.mean(times), 4),
                          "min": round(min(times), 4), "gpus": args.gpus, "label": args.label,
                          "overrides": " ".join(args.overrides)}), flush=True)


if __name__ == "__main__":
    main()
