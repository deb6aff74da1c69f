"""Probe (issue 33): where a `launch recipe=imagefolder` epoch spends the GPU, stream by stream, from its trace.

    python bench/probe/imagefolder_profile.py --root /tmp/imagenet-gen --variant data.decode=auto \\
        --variant data.decode=cpu

Each variant is one `launch recipe=imagefolder data.root=ROOT gpus=[0] perf.compile=true eval.every=0 epochs=2
profile=true ...`; the launcher profiles its second epoch (torch.profiler) and writes trace.json. Prints one
JSON line per variant: the epoch's GPU window and the steps in it, and per CUDA stream its kernels' summed
time and busy time (a step's share: ms per step), the top kernels of each, and the main stream's idle gaps
(the time the training stream had nothing to run). The stream with the most kernel time is the training one.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fast_profile import GPU_CATS, busy_union  # noqa: E402


def analyse(trace: dict, top: int) -> dict:
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    gpu = [e for e in events if e.get("cat") in GPU_CATS]
    if not gpu:
        return {"error": "no GPU events in the trace"}
    start = min(e["ts"] for e in gpu)
    window = max(e["ts"] + e.get("dur", 0) for e in gpu) - start
    streams: dict[str, list[dict]] = defaultdict(list)
    for e in gpu:
        streams[str((e.get("args") or {}).get("stream", e.get("tid")))].append(e)
    steps = sum(1 for e in events if e.get("cat") == "kernel" and "sgd" in e["name"].lower()) or None
    rows = {}
    for sid, evs in sorted(streams.items(), key=lambda kv: -sum(e.get("dur", 0) for e in kv[1])):
        spans = [(e["ts"], e["ts"] + e.get("dur", 0)) for e in evs]
        by: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
        for e in evs:
            by[e["name"][:90]][0] += e.get("dur", 0)
            by[e["name"][:90]][1] += 1
        rows[sid] = {"events": len(evs), "sum_ms": round(sum(e.get("dur", 0) for e in evs) / 1000, 2),
                     "busy_ms": round(busy_union(spans) / 1000, 2),
                     "top": [[k, round(v[0] / 1000, 2), v[1]] for k, v in
                             sorted(by.items(), key=lambda kv: -kv[1][0])[:top]]}
    main_id = next(iter(rows))
    main = sorted((e["ts"], e["ts"] + e.get("dur", 0)) for e in streams[main_id])
    gaps, end = [], main[0][1]
    for a, b in main[1:]:
        if a > end:
            gaps.append(a - end)
        end = max(end, b)
    gaps.sort(reverse=True)
    all_busy = busy_union([(e["ts"], e["ts"] + e.get("dur", 0)) for e in gpu])
    return {"gpu_window_ms": round(window / 1000, 1), "gpu_busy_ms": round(all_busy / 1000, 1),
            "optimizer_kernels": steps, "main_stream": main_id,
            "main_idle_ms": round(sum(gaps) / 1000, 1), "main_gaps_over_1ms": sum(g > 1000 for g in gaps),
            "main_largest_gaps_ms": [round(g / 1000, 2) for g in gaps[:8]], "streams": rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", default="/tmp/imagenet-gen")
    p.add_argument("--variant", action="append", default=None)
    p.add_argument("--top", type=int, default=8)
    p.add_argument("--timeout", type=int, default=240)
    args = p.parse_args()
    for variant in args.variant or ["data.decode=auto"]:
        with tempfile.TemporaryDirectory(prefix="if-profile-") as scratch:
            run_dir = Path(scratch) / "run"
            cmd = [sys.executable, "-m", "launcher", "recipe=imagefolder", f"data.root={args.root}", "gpus=[0]",
                   "perf.compile=true", "eval.every=0", "epochs=2", "profile=true", f"hydra.run.dir={run_dir}",
                   *variant.split()]
            try:
                proc = subprocess.run(cmd, cwd=scratch, capture_output=True, text=True, timeout=args.timeout)
                code, text = proc.returncode, proc.stdout + proc.stderr
            except subprocess.TimeoutExpired as exc:
                code, text = "timeout", str(exc.stdout or "") + str(exc.stderr or "")
            row: dict = {"variant": variant, "exit_code": code,
                         "epoch_lines": [ln.strip()[-160:] for ln in text.splitlines() if "epoch" in ln
                                         and "images/s" in ln][-3:]}
            trace = run_dir / "trace.json"
            if trace.exists():
                row.update(analyse(json.loads(trace.read_text()), args.top))
            else:
                row["output_tail"] = text[-1500:]
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
