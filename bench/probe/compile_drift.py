"""Is compiled fsdp's loss apart from eager fsdp's a compile effect or an fsdp one? The GPU test's small GPT
(tests/gpu/test_gpu_text_fsdp.py SMALL, one epoch unless --epochs) under strategy=single and strategy=fsdp, eager and
compiled, on one GPU; one JSON line per run: final test loss, bits/byte, tokens/s.

    bash bench/on_device.sh py bench/probe/compile_drift.py [--seeds 0 1]
"""
import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

SMALL = ["recipe=text", "recipe.max_bytes=2000000", "recipe.layers=4", "recipe.width=256", "recipe.heads=4",
         "recipe.context=256", "batch_size=32", "lr=2e-3", "recipe.sample_bytes=0", "gpus=[0]",
         "checkpoint=false", "progress=lines"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--strategies", nargs="+", default=["single", "fsdp"])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            for strategy in args.strategies:
                for compiled in ("false", "true"):
                    run_dir = Path(tmp) / f"{strategy}-{compiled}-{seed}"
                    cmd = ["launch", *SMALL, f"seed={seed}", f"epochs={args.epochs}", f"strategy={strategy}",
                           f"perf.compile={compiled}", f"data.root={tmp}/data", f"hydra.run.dir={run_dir}"]
                    proc = subprocess.run(cmd, capture_output=True, text=True)
                    row = {"strategy": strategy, "compile": compiled, "seed": seed, "epochs": args.epochs,
                           "rc": proc.returncode}
                    if proc.returncode == 0:
                        r = json.loads((run_dir / "results.json").read_text())
                        row.update(compiled=r.get("compiled"), **{k: r["final"].get(k) for k in
                                   ("test_loss", "test_bpb", "loss", "tokens_per_s")})
                    else:
                        row["tail"] = proc.stdout[-800:] + proc.stderr[-800:]
                    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    sys.exit(main())
