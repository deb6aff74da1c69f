"""Multi-GPU scaling and start-up: `launch` (1 GPU, dp, ddp) beside plain DDP under torchrun, in one call.

    python bench/scaling.py                         # needs 2 GPUs; fast net @1024/GPU, ResNet-18 @512/GPU
    python bench/scaling.py --models resnet18 --epochs 4

Throughput: each configuration runs as its own command (a subprocess, as a user types it) on
CIFAR-shaped synthetic data; img/s excludes the first epoch. `vs_one_gpu` compares torchrun's rows
with its 1-GPU run; `vs_best_one_gpu` compares launch's 2-GPU rows with the faster of its 1-GPU
variants (eager or perf.cuda_graph=true), the fair bar for a speed-up. The torchrun rows run
bench/torchrun_ddp.py, a plain DDP script on the same networks.

Start-up: seconds from the command starting to (a) `import torch; torch.cuda.init()` finishing,
(b) torchrun's 2 processes having initialized NCCL and all-reduced one tensor, (c) `launch`'s first
training step on 2 GPUs (the tiny digits recipe, so data and model cost little), twice, with launch's
own itemized timeline (launcher/train/timeline.py), and (d) torchrun again with launch's bytecode cache,
when launch made one (see startup_rows).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from launch_run import run_launch  # noqa: E402
from strategies import PER_GPU_BATCH, run  # noqa: E402

HERE = Path(__file__).parent

# (variant, gpus, strategy, overrides): 1-GPU variants first, so the 2-GPU rows compare with the best of them.
GRAPH, EAGER = ("perf.cuda_graph=true",), ("perf.cuda_graph=false",)
LAUNCH_RUNS = (
    ("1 GPU", [0], "single", EAGER),
    ("1 GPU, cuda_graph", [0], "single", GRAPH),
    ("dp", [0, 1], "dp", EAGER),
    ("ddp", [0, 1], "ddp", EAGER),
    ("ddp, cuda_graph", [0, 1], "ddp", GRAPH),
)


def torchrun(args: list[str], nprocs: int, env: dict[str, str] | None = None) -> dict:
    env = {**(env or os.environ), "BENCH_T0": repr(time.time())}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nprocs}",
               str(HERE / "torchrun_ddp.py"), *args]
    start = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"exit_code": proc.returncode, "error": (proc.stderr or proc.stdout).strip().splitlines()[-3:]}
    return {**json.loads(lines[-1]), "exit_code": 0, "wall_s": round(wall, 2)}


def cuda_init_seconds() -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch; torch.cuda.init()"], check=True)
    return round(time.perf_counter() - start, 2)


def launch_startup(label: str) -> dict:
    run = run_launch("recipe=digits", "gpus=[0,1]", "epochs=1")
    if not run.ok:
        return {"exit_code": run.exit_code, "error": run.error_tail()}
    r = run.results
    return {"what": "launch_startup", "label": label, "recipe": "digits", "world_size": r["world_size"],
            "first_step_s": run.first_step_from_command_s(), "startup": r["startup"], "wall_s": run.wall_s,
            "bytecode_cache": "keeping it under" in run.output}


def startup_rows() -> list[dict]:
    """torchrun, then launch twice (on a host whose torch has no bytecode, the first launch fills
    launcher/bytecode.py's cache and the second reads it), then torchrun given that same cache: the
    fair comparison for the second launch."""
    rows = [{"what": "python_cuda_init", "seconds": cuda_init_seconds()},
            {**torchrun(["--startup-only"], 2), "label": "as installed"},
            launch_startup("first launch"), launch_startup("second launch")]
    from launcher.bytecode import cache_dir

    if cache_dir(os.environ).exists():
        cached = {**os.environ, "PYTHONPYCACHEPREFIX": str(cache_dir(os.environ))}
        rows.append({**torchrun(["--startup-only"], 2, cached), "label": "with launch's bytecode cache"})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["airbench", "resnet18"])
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--skip-startup", action="store_true")
    parser.add_argument("--skip-dp", action="store_true")
    parser.add_argument("--skip-torchrun", action="store_true")
    parser.add_argument("--only", nargs="*", help="run only these launch variants (e.g. '1 GPU, cuda_graph')")
    parser.add_argument("--extra", nargs="*", default=[], help="overrides added to every launch run")
    args = parser.parse_args()
    stamp = {"date": time.strftime("%Y-%m-%d")}
    # Start-up first, on a machine that has not run anything yet in this call.
    if not args.skip_startup:
        for row in startup_rows():
            print(json.dumps({**row, **stamp}), flush=True)
    if args.skip_throughput:
        return
    for model in args.models:
        per_gpu = PER_GPU_BATCH[model]
        best_one_gpu = None
        for name, gpus, strategy, extra in LAUNCH_RUNS:
            if (strategy == "dp" and args.skip_dp) or (args.only and name not in args.only):
                continue
            record = {"what": "launch", "variant": name, **run(model, gpus, strategy, args.epochs,
                                                                (*extra, *args.extra))}
            speed = record.get("img_per_s")
            if len(gpus) == 1 and speed:
                best_one_gpu = max(best_one_gpu or 0, speed)
            elif best_one_gpu and speed:
                record["vs_best_one_gpu"] = round(speed / best_one_gpu, 3)
            print(json.dumps({**record, **stamp}), flush=True)
        base = None
        for nprocs in () if args.skip_torchrun else (1, 2):
            record = torchrun(["--model", model, "--batch-per-gpu", str(per_gpu), "--epochs", str(args.epochs)],
                              nprocs)
            base = record.get("img_per_s") if nprocs == 1 else base
            if base and record.get("img_per_s"):
                record["vs_one_gpu"] = round(record["img_per_s"] / base, 3)
            print(json.dumps({**record, **stamp}), flush=True)

if __name__ == "__main__":
    main()
