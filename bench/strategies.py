"""Throughput of `launch` itself for each strategy, one JSON line per run, on CIFAR-shaped synthetic data.

    python bench/strategies.py                      # every strategy the machine's GPUs allow
    python bench/strategies.py --models resnet18 --epochs 4

Runs the real CLI (a subprocess per configuration, as a user would) and reads img/s from each run's
metrics.jsonl. The first epoch (cuDNN autotuning, allocator warm-up) is left out of the figure.
Batch sizes are per GPU, so the global batch grows with the GPU count (`batch_size` is global).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PER_GPU_BATCH = {"airbench": 1024, "resnet18": 512, "mobilenetv3_small": 512}


def run(model: str, gpus: list[int], strategy: str, epochs: int, workdir: Path, extra: tuple[str, ...] = ()) -> dict:
    per_gpu = PER_GPU_BATCH[model]
    n = len(gpus)
    overrides = ["recipe=cifar10", "data.synthetic=true", f"recipe.model={model}", f"epochs={epochs}",
                 f"batch_size={per_gpu * n}", f"gpus=[{','.join(map(str, gpus))}]", f"strategy={strategy}", *extra]
    cwd = Path(tempfile.mkdtemp(dir=workdir))
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "launcher.cli", *overrides], cwd=cwd, capture_output=True, text=True)
    wall = time.perf_counter() - start
    record = {"model": model, "strategy": strategy, "gpus": n, "batch_per_gpu": per_gpu, "global_batch": per_gpu * n,
              "epochs": epochs, "exit_code": proc.returncode, "wall_s": round(wall, 2)}
    results = list(cwd.glob("outputs/**/results.json"))
    if proc.returncode != 0 or not results:
        record["error"] = (proc.stderr or proc.stdout).strip().splitlines()[-1:]
        return record
    run_dir = results[0].parent
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steady = rows[1:] or rows
    res = json.loads(results[0].read_text())
    record.update({
        "img_per_s": round(sum(r["img_per_s"] for r in steady) / len(steady)),
        "first_step_s": round(res["first_step_s"], 2),
        "startup": res.get("startup"),
        "max_mem_allocated_mb": rows[-1]["max_mem_allocated_mb"],
        "device": (res["devices"] or ["cpu"])[0],
        "torch": res["torch"],
    })
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["airbench", "resnet18"])
    parser.add_argument("--epochs", type=int, default=4)
    args = parser.parse_args()
    import torch

    count = torch.cuda.device_count()
    if count == 0:
        sys.exit("bench/strategies.py needs a GPU")
    plans = [([0], "single")]
    if count >= 2:
        plans += [([0, 1], "dp"), ([0, 1], "ddp")]
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models:
            base = None
            for gpus, strategy in plans:
                record = run(model, gpus, strategy, args.epochs, Path(tmp))
                if strategy == "single":
                    base = record.get("img_per_s")
                if base and record.get("img_per_s"):
                    record["vs_one_gpu"] = round(record["img_per_s"] / base, 2)
                print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
