"""launch against the best plain script a skilled user would write, in one call (issue 15).

    python bench/peers.py                                   # 2 GPUs: ResNet-18 @512/GPU, fast net @1024/GPU
    python bench/peers.py --models resnet18 --runs launch:graph+compile:2 script:reduce-overhead:2

Each run is its own command, as a user types it, on CIFAR-shaped synthetic data (the same work on both
sides: the network, the batch per GPU, GPU-resident uint8 data, a random flip and a 2-pixel reflect
shift per image on the GPU, bf16, channels_last, SGD with Nesterov momentum, label smoothing 0.2).

    launch:VARIANT:GPUS     `launch recipe=cifar10 ...` with VARIANT's perf settings (VARIANTS below)
    script:MODE:GPUS        bench/torchrun_ddp.py under torchrun: DDP, --compile MODE (none, default,
                            reduce-overhead, max-autotune-no-cudagraphs)

1-GPU runs go two at a time, one per GPU. img/s is the device clock of the slowest rank over the
epochs after the first; wall_img_per_s counts everything between those epochs' starts (checkpoint
snapshots, logs, buffer averaging), evaluation excepted. After the runs of a model, one `summary`
line: the best 1-GPU img/s of launch (any variant) and of the script, and each 2-GPU launch run's
ratio to those and to the script's 2-GPU runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from scaling import torchrun  # noqa: E402
from strategies import PER_GPU_BATCH, run  # noqa: E402

VARIANTS = {
    "default": (),  # whatever launch picks for the run (perf.compile=auto)
    "graph": ("perf.cuda_graph=true", "perf.compile=false"),
    "graph+compile": ("perf.cuda_graph=true", "perf.compile=true"),
    "compile-reduce-overhead": ("perf.cuda_graph=false", "perf.compile=true", "perf.compile_mode=reduce-overhead"),
    "eager": ("perf.cuda_graph=false", "perf.compile=false"),
}
DEFAULT_RUNS = ("launch:graph:1", "launch:graph+compile:1", "script:reduce-overhead:1",
                "launch:graph:2", "launch:graph+compile:2", "script:reduce-overhead:2")


def one(kind: str, what: str, gpus: int, model: str, epochs: int, extra: list[str], env: dict[str, str]) -> dict:
    if kind == "launch":
        record = run(model, list(range(gpus)), "single" if gpus == 1 else "ddp", epochs, (*VARIANTS[what], *extra),
                     env=env)
        return {"what": "launch", "variant": what, **record}
    record = torchrun(["--model", model, "--batch-per-gpu", str(PER_GPU_BATCH[model]), "--epochs", str(epochs),
                       "--compile", what], gpus, env)
    return {**record, "what": "script", "variant": what, "model": model, "gpus": gpus}


def gpu_count() -> int:
    import subprocess

    listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout
    return max(1, sum(line.startswith("GPU ") for line in listed.splitlines()))


def summary(model: str, rows: list[dict]) -> dict:
    def best(kind: str, gpus: int) -> float | None:
        speeds = [r["img_per_s"] for r in rows if r["what"] == kind and r["gpus"] == gpus and r.get("img_per_s")]
        return max(speeds) if speeds else None

    out: dict = {"what": "summary", "model": model, "launch_best_1gpu": best("launch", 1),
                 "script_best_1gpu": best("script", 1), "script_best_2gpu": best("script", 2), "ratios": {}}
    for r in rows:
        if r["what"] != "launch" or r["gpus"] != 2 or not r.get("img_per_s"):
            continue
        ratios = {}
        for name, base in (("vs_launch_best_1gpu", out["launch_best_1gpu"]),
                           ("vs_script_best_1gpu", out["script_best_1gpu"]),
                           ("vs_script_best_2gpu", out["script_best_2gpu"])):
            if base:
                ratios[name] = round(r["img_per_s"] / base, 3)
        one_gpu_wall = [x.get("wall_img_per_s") for x in rows if x["what"] == "launch" and x["gpus"] == 1]
        if r.get("wall_img_per_s") and any(one_gpu_wall):
            ratios["wall_vs_launch_best_1gpu"] = round(r["wall_img_per_s"] / max(w for w in one_gpu_wall if w), 3)
        out["ratios"][r["variant"]] = ratios
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["resnet18", "airbench"])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--runs", nargs="+", default=list(DEFAULT_RUNS), help="KIND:VARIANT:GPUS ...")
    parser.add_argument("--extra", nargs="*", default=[], help="overrides added to every launch run")
    parser.add_argument("--env", nargs="*", default=[], help="NAME=VALUE set for every run")
    args = parser.parse_args()
    env = {**os.environ, **dict(item.split("=", 1) for item in args.env)}
    stamp = {"date": time.strftime("%Y-%m-%d")}
    for model in args.models:
        rows = []
        specs = [(kind, what, int(gpus)) for kind, what, gpus in (spec.split(":") for spec in args.runs)]
        singles = [s for s in specs if s[2] == 1]
        # 1-GPU runs go two at a time, one on each GPU (they do not slow each other: BENCHMARKS.md),
        # one at a time on a machine of one GPU
        slots = min(2, gpu_count())
        for pair in (singles[i:i + slots] for i in range(0, len(singles), slots)):
            with ThreadPoolExecutor(len(pair)) as pool:
                done = pool.map(lambda slot, pair=pair, model=model: one(
                    *pair[slot], model, args.epochs, args.extra, {**env, "CUDA_VISIBLE_DEVICES": str(slot)}),
                    range(len(pair)))
                for row in done:
                    rows.append(row)
                    print(json.dumps({**row, **stamp}), flush=True)
        for spec in (s for s in specs if s[2] != 1):
            row = one(*spec, model, args.epochs, args.extra, env)
            rows.append(row)
            print(json.dumps({**row, **stamp}), flush=True)
        print(json.dumps({**summary(model, rows), "env": args.env, **stamp}), flush=True)


if __name__ == "__main__":
    main()
