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
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from launch_run import run_launch  # noqa: E402

PER_GPU_BATCH = {"airbench": 1024, "resnet18": 512, "mobilenetv3_small": 512}


def run(model: str, gpus: list[int], strategy: str, epochs: int, extra: tuple[str, ...] = (), **how) -> dict:
    """One `launch` of the cifar10 recipe on synthetic data; `how` goes to run_launch (env, module)."""
    per_gpu = PER_GPU_BATCH[model]
    n = len(gpus)
    launched = run_launch("recipe=cifar10", "data.synthetic=true", f"recipe.model={model}", f"epochs={epochs}",
                          f"batch_size={per_gpu * n}", f"gpus=[{','.join(map(str, gpus))}]", f"strategy={strategy}",
                          *extra, **how)
    record = {"model": model, "strategy": strategy, "gpus": n, "batch_per_gpu": per_gpu, "global_batch": per_gpu * n,
              "epochs": epochs, "exit_code": launched.exit_code, "wall_s": launched.wall_s}
    if not launched.ok:
        record["error"] = launched.error_tail(1)
        return record
    rows, res = launched.metrics, launched.results
    steady = rows[1:] or rows
    record.update({
        "img_per_s": round(sum(r["img_per_s"] for r in steady) / len(steady)),
        "wall_img_per_s": wall_img_per_s(rows),
        "first_step_s": round(res["first_step_s"], 2),
        "startup": res.get("startup"),
        "host_issue_s": round(sum(r["host_issue_s"] for r in steady) / len(steady), 4),
        "train_s": round(sum(r["train_s"] for r in steady) / len(steady), 4),
        "input_stall": round(sum(r["input_stall"] for r in steady) / len(steady), 4),
        "cuda_graph": res.get("cuda_graph"),
        "compiled": res.get("compiled"),
        "warmup_s": res.get("timed", {}).get("compile_warmup_s"),
        "max_mem_allocated_mb": rows[-1]["max_mem_allocated_mb"],
        # per epoch: the host's start, the device spans, the host's issue time (the gaps between epochs)
        "per_epoch": [{k: r.get(k) for k in ("started_unix", "train_s", "eval_s", "epoch_s", "host_issue_s",
                                             "input_stall")} for r in rows],
        "device": (res["devices"] or ["cpu"])[0],
        "torch": res["torch"],
    })
    return record


def wall_img_per_s(rows: list[dict]) -> int | None:
    """Images per second of wall time from epoch 2's start to the last epoch's start: everything a run
    does between epochs counts (checkpoint snapshot, buffer averaging, logs) except evaluation, unlike
    `img_per_s`, which is the slowest rank's training span on the device clock."""
    if len(rows) < 3 or "started_unix" not in rows[0]:
        return None
    per_epoch = rows[0]["img_per_s"] * rows[0]["train_s"]
    seconds = rows[-1]["started_unix"] - rows[1]["started_unix"] - sum(r.get("eval_s", 0.0) for r in rows[1:-1])
    return round(per_epoch * (len(rows) - 2) / seconds)


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
    for model in args.models:
        base = None
        for gpus, strategy in plans:
            record = run(model, gpus, strategy, args.epochs)
            if strategy == "single":
                base = record.get("img_per_s")
            if base and record.get("img_per_s"):
                record["vs_one_gpu"] = round(record["img_per_s"] / base, 2)
            print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
