"""Two versions of `launch` on the same machine, in one call: does a change cost throughput?

    # an older launch installed apart (its own entry module), the current one as the repository has it
    mkdir .bench-base && git archive f78d1c4 | tar -x -C .bench-base
    pip install --no-deps --no-build-isolation --target /tmp/base .bench-base
    python bench/versions.py --base-path /tmp/base --base-module launcher --label-base f78d1c4

For every (network, GPU list) the same command (recipe=cifar10, data.synthetic=true, default settings:
perf.cuda_graph on, strategy auto) runs through the base version and the current one, alternating which
goes first, `--repeats` times. One JSON line per run (bench/strategies.py's record: device-clock img/s
without the first epoch, wall-clock img/s, first step), then one line per configuration with the
current/base ratio of the median img/s and the spread of each version's repeats, so that a difference
can be told from noise.
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
from strategies import run  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-path", required=True, help="a folder an older launch is installed in (pip --target)")
    parser.add_argument("--base-module", default="launcher",
                        help="its entry module (python -m ...; `launcher.cli` before 0.2)")
    parser.add_argument("--label-base", default="base")
    parser.add_argument("--models", nargs="+", default=["airbench", "resnet18"])
    parser.add_argument("--gpus", nargs="+", default=["0", "0,1"], help="GPU lists, e.g. 0 0,1")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--extra", nargs="*", default=[], help="overrides for both versions, e.g. perf.compile=true")
    args = parser.parse_args()
    base_env = {**os.environ, "PYTHONPATH": os.pathsep.join([args.base_path, os.environ.get("PYTHONPATH", "")])}
    versions = {args.label_base: {"env": base_env, "module": args.base_module}, "current": {"module": "launcher"}}
    stamp = {"date": time.strftime("%Y-%m-%d")}
    for model in args.models:
        for gpus_text in args.gpus:
            gpus = [int(g) for g in gpus_text.split(",")]
            speeds: dict[str, list[float]] = {name: [] for name in versions}
            for repeat in range(args.repeats):
                order = list(versions) if repeat % 2 == 0 else list(versions)[::-1]
                for name in order:
                    record = run(model, gpus, "auto", args.epochs, tuple(args.extra), **versions[name])
                    print(json.dumps({"what": "version", "version": name, "repeat": repeat, **record, **stamp}),
                          flush=True)
                    if record.get("img_per_s"):
                        speeds[name].append(record["img_per_s"])
            base, current = (speeds[n] for n in versions)
            if base and current:
                print(json.dumps({
                    "what": "versions_ratio", "model": model, "gpus": len(gpus), "base": args.label_base,
                    "base_img_per_s": sorted(base), "current_img_per_s": sorted(current),
                    "current_vs_base": round(statistics.median(current) / statistics.median(base), 3),
                    "base_spread": round((max(base) - min(base)) / statistics.median(base), 3),
                    "current_spread": round((max(current) - min(current)) / statistics.median(current), 3),
                    **stamp}), flush=True)


if __name__ == "__main__":
    main()
