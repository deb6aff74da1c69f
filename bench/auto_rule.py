"""Both sides of perf.compile=auto's rule (launcher/train/compiling.py): time to result, auto against the other choice.

    python bench/auto_rule.py --model resnet18 --gpus 0 --short 30 --long 150

For a run shorter than the bound (`--short` epochs: the epochs after the first take less than
perf.compile_auto_min_s uncompiled) auto should not compile, and is timed against perf.compile=true;
for a longer one (`--long`) it should compile after epoch 1, and is timed against perf.compile=false.
Each run is one `launch recipe=cifar10 data.synthetic=true ...` with an empty inductor cache of its
own (a first compile on the machine: the case the bound is set for). The figure is the command's wall
time, start to exit: what a user waits for. One JSON line per run, then one per side saying which
choice was faster and whether auto made it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from launch_run import run_launch  # noqa: E402
from strategies import PER_GPU_BATCH  # noqa: E402


def one(model: str, gpus: list[int], epochs: int, compile_: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="inductor-") as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
        run = run_launch("recipe=cifar10", "data.synthetic=true", f"recipe.model={model}", f"epochs={epochs}",
                         f"batch_size={PER_GPU_BATCH[model] * len(gpus)}", f"gpus=[{','.join(map(str, gpus))}]",
                         f"perf.compile={compile_}", "eval.every=0", env=env)
    row = {"model": model, "gpus": len(gpus), "epochs": epochs, "perf.compile": compile_, "exit_code": run.exit_code,
           "wall_s": run.wall_s}
    if not run.ok:
        return {**row, "error": run.error_tail(2)}
    r = run.results
    return {**row, "compiled": r.get("compiled"), "compile_decision": r.get("compile_decision"),
            "warmup_s": round(r["timed"].get("compile_warmup_s") or 0, 1), "train_s": round(r["timed"]["train_s"], 2),
            "first_epoch_img_per_s": round(run.metrics[0]["img_per_s"]),
            "last_epoch_img_per_s": round(run.metrics[-1]["img_per_s"]),
            "device": (r["devices"] or ["cpu"])[0], "torch": r["torch"], "date": time.strftime("%Y-%m-%d")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="resnet18")
    p.add_argument("--gpus", default="0", help="comma-separated GPU ids")
    p.add_argument("--short", type=int, default=30, help="epochs of a run below the bound")
    p.add_argument("--long", type=int, default=150, help="epochs of a run above it")
    args = p.parse_args()
    gpus = [int(g) for g in args.gpus.split(",")]
    for side, epochs, other in (("short", args.short, "true"), ("long", args.long, "false")):
        auto = one(args.model, gpus, epochs, "auto")
        print(json.dumps(auto), flush=True)
        alt = one(args.model, gpus, epochs, other)
        print(json.dumps(alt), flush=True)
        if "error" in auto or "error" in alt:
            continue
        faster = "auto" if auto["wall_s"] <= alt["wall_s"] else f"perf.compile={other}"
        print(json.dumps({"side": side, "epochs": epochs, "auto_compiled": auto["compiled"],
                          "auto_wall_s": auto["wall_s"], f"compile_{other}_wall_s": alt["wall_s"],
                          "faster": faster, "auto_chose_right": faster == "auto"}), flush=True)


if __name__ == "__main__":
    main()
