"""Probe (issue 15): where one epoch of `recipe=cifar10_fast` spends the GPU's time, read from its trace.

    python bench/probe/fast_profile.py                                   # the recipe as it is
    python bench/probe/fast_profile.py --variant perf.compile_mode=default --variant perf.cuda_graph=true

Each variant is one `launch recipe=cifar10_fast gpus=[0] data.synthetic=true profile=true ...`; the
launcher profiles its second epoch (25 steps) and writes trace.json. This reads the trace and prints one
JSON line per variant: the epoch's GPU window, how much of it some kernel/copy ran (busy) and the idle rest,
the kernel time grouped by kernel name (top N), and the host's CUDA runtime calls (launches, graph
launches, syncs). --keep DIR copies each trace (gzipped) there.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}


def busy_union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if start > end:
            total += stop - start
            end = stop
        elif stop > end:
            total += stop - end
            end = stop
    return total


def analyse(trace: dict, top: int) -> dict:
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    gpu = [e for e in events if e.get("cat") in GPU_CATS]
    if not gpu:
        return {"error": "no GPU events in the trace"}
    spans = [(e["ts"], e["ts"] + e.get("dur", 0)) for e in gpu]
    window = max(s[1] for s in spans) - min(s[0] for s in spans)
    busy = busy_union(spans)
    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in gpu:
        row = by_name[e["name"][:140]]
        row[0] += e.get("dur", 0)
        row[1] += 1
    runtime: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in events:
        if e.get("cat") == "cuda_runtime":
            row = runtime[e["name"]]
            row[0] += e.get("dur", 0)
            row[1] += 1
    kernels = sorted(by_name.items(), key=lambda kv: -kv[1][0])
    return {
        "gpu_window_ms": round(window / 1000, 2), "gpu_busy_ms": round(busy / 1000, 2),
        "gpu_idle_ms": round((window - busy) / 1000, 2), "gpu_events": len(gpu),
        "kernel_ms_total": round(sum(v[0] for v in by_name.values()) / 1000, 2),
        "top": [[name, round(v[0] / 1000, 3), v[1]] for name, v in kernels[:top]],
        "runtime": {k: [round(v[0] / 1000, 2), v[1]]
                    for k, v in sorted(runtime.items(), key=lambda kv: -kv[1][0])[:12]},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variant", action="append", default=None,
                   help="space-separated launch overrides for one variant ('' = the recipe as it is)")
    p.add_argument("--top", type=int, default=45)
    p.add_argument("--keep", type=Path, default=None)
    p.add_argument("--base", default=None, help="another launcher tree (pip --target dir), first on the path")
    args = p.parse_args()
    for variant in args.variant or [""]:
        overrides = variant.split()
        with tempfile.TemporaryDirectory(prefix="fast-profile-") as scratch:
            run_dir = Path(scratch) / "run"
            cmd = [sys.executable, "-m", "launcher", "recipe=cifar10_fast", "gpus=[0]", "data.synthetic=true",
                   "profile=true", f"hydra.run.dir={run_dir}", *overrides]
            env = None
            if args.base:
                env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [args.base,
                                                                                 os.environ.get("PYTHONPATH")]))}
            proc = subprocess.run(cmd, cwd=scratch, capture_output=True, text=True, env=env)
            row: dict = {"variant": variant or "(recipe)", "base": args.base, "exit_code": proc.returncode}
            trace_path = run_dir / "trace.json"
            results = run_dir / "results.json"
            if results.exists():
                r = json.loads(results.read_text())
                row["train_eval_s"] = r.get("timed", {}).get("train_eval_s")
            if trace_path.exists():
                row.update(analyse(json.loads(trace_path.read_text()), args.top))
                if args.keep:
                    args.keep.mkdir(parents=True, exist_ok=True)
                    name = (variant or "recipe").replace(" ", "_").replace("/", "-").replace("=", "-")
                    with trace_path.open("rb") as src, gzip.open(args.keep / f"trace-{name}.json.gz", "wb") as dst:
                        shutil.copyfileobj(src, dst)
            else:
                row["output_tail"] = (proc.stdout + proc.stderr)[-1500:]
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
