"""Probe (issue 33): where a `launch recipe=imagefolder` epoch spends the GPU, stream by stream, from its trace.

    python bench/probe/imagefolder_profile.py --root /tmp/imagenet-gen --variant data.decode=auto \\
        --variant data.decode=cpu

Each variant is one `launch recipe=imagefolder data.root=ROOT gpus=[0] perf.compile=true eval.every=0 epochs=3
profile=true ...`; the launcher profiles its second epoch (torch.profiler; the third is not profiled: its
epoch line is the speed) and writes trace.json. Prints one
JSON line per variant: the epoch's GPU window and the steps in it, and per CUDA stream its kernels' summed
time and busy time (a step's share: ms per step), the top kernels of each, and the main stream's idle gaps
(the time the training stream had nothing to run), and which host thread and op issued the GPU events
that --who names. The stream with the most kernel time is the training one.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fast_profile import GPU_CATS, busy_union  # noqa: E402


def launched_by(events: list[dict], names: dict, pattern: str) -> dict:
    """For the GPU events whose name matches `pattern`: counted by the host thread that issued them and the
    CPU ops (innermost three) around the runtime call that did (matched by the trace's correlation ids)."""
    wanted = re.compile(pattern)
    runtime = {(e.get("args") or {}).get("correlation"): e for e in events if e.get("cat") == "cuda_runtime"}
    ops: dict[tuple, list[dict]] = defaultdict(list)
    for e in events:
        if e.get("cat") == "cpu_op":
            ops[(e.get("pid"), e.get("tid"))].append(e)
    found: dict[str, int] = defaultdict(int)
    for e in events:
        if e.get("cat") not in GPU_CATS or not wanted.search(e["name"]):
            continue
        call = runtime.get((e.get("args") or {}).get("correlation"))
        if call is None:
            found[f"{e['name'][:50]} <- (no runtime call in the trace)"] += 1
            continue
        key = (call.get("pid"), call.get("tid"))
        around = sorted((o for o in ops[key] if o["ts"] <= call["ts"] <= o["ts"] + o.get("dur", 0)),
                        key=lambda o: -o["ts"])[:3]
        thread = names.get(key, str(call.get("tid")))
        found[f"{e['name'][:50]} <- {thread}: {' < '.join(o['name'][:40] for o in around) or call['name']}"] += 1
    return dict(sorted(found.items(), key=lambda kv: -kv[1])[:12])


def host_threads(events: list[dict], names: dict, start: float, end: float) -> dict:
    """The host side of the epoch: per thread, its ops' busy time in [start, end); for the thread that
    launched the most kernels (the training loop's), the time it ran no op at all (its gaps over 0.2 ms: a
    wait for the GIL, a blocking call, sleep) and which other threads ran ops during its longest gaps."""
    ops: dict[tuple, list[tuple[float, float]]] = defaultdict(list)
    launches: dict[tuple, int] = defaultdict(int)
    for e in events:
        if not (start <= e["ts"] < end):
            continue
        key = (e.get("pid"), e.get("tid"))
        if e.get("cat") in ("cpu_op", "python_function", "user_annotation"):
            ops[key].append((e["ts"], e["ts"] + e.get("dur", 0)))
        elif e.get("cat") == "cuda_runtime" and "Launch" in e["name"]:
            launches[key] += 1
    if not launches:
        return {}
    loop = max(launches, key=launches.get)
    spans = sorted(ops[loop])
    gaps, last = [], spans[0][1] if spans else start
    for a, b in spans[1:]:
        if a - last > 200:
            gaps.append((a - last, last, a))
        last = max(last, b)
    gaps.sort(reverse=True)
    during: dict[str, float] = defaultdict(float)
    for _, a, b in gaps[:50]:
        for key, sp in ops.items():
            if key != loop:
                covered = busy_union([(max(a, x), min(b, y)) for x, y in sp if x < b and y > a])
                if covered:
                    during[names.get(key, str(key[1]))] += covered
    outer: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])  # the loop thread's outermost ops, by name
    reach = float("-inf")
    for e in sorted((e for e in events if (e.get("pid"), e.get("tid")) == loop and start <= e["ts"] < end
                     and e.get("cat") in ("cpu_op", "user_annotation")), key=lambda e: (e["ts"], -e.get("dur", 0))):
        if e["ts"] >= reach:
            outer[e["name"][:60]][0] += e.get("dur", 0)
            outer[e["name"][:60]][1] += 1
            reach = e["ts"] + e.get("dur", 0)
    return {"loop_thread": names.get(loop, str(loop[1])), "loop_launches": launches[loop],
            "loop_outer_ops_ms": [[k, round(v[0] / 1000, 1), v[1]] for k, v in
                                  sorted(outer.items(), key=lambda kv: -kv[1][0])[:12]],
            "loop_op_ms": round(busy_union(spans) / 1000, 1),
            "loop_gaps_over_0.2ms": len(gaps), "loop_gap_ms": round(sum(g for g, _, _ in gaps) / 1000, 1),
            "loop_largest_gaps_ms": [round(g / 1000, 2) for g, _, _ in gaps[:8]],
            "others_busy_in_50_longest_gaps_ms": {k: round(v / 1000, 1) for k, v in
                                                   sorted(during.items(), key=lambda kv: -kv[1])[:6]},
            "threads_op_ms": {names.get(k, str(k[1])): round(busy_union(sorted(v)) / 1000, 1)
                              for k, v in sorted(ops.items(), key=lambda kv: -len(kv[1]))[:8]}}


def analyse(trace: dict, top: int, who: str) -> dict:
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    names = {(e.get("pid"), e.get("tid")): (e.get("args") or {}).get("name", "")
             for e in trace.get("traceEvents", []) if e.get("ph") == "M" and e.get("name") == "thread_name"}
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
            "main_largest_gaps_ms": [round(g / 1000, 2) for g in gaps[:8]],
            "launched_by": launched_by(events, names, who) if who else {},
            "host": host_threads(events, names, start, start + window), "streams": rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", default="/tmp/imagenet-gen")
    p.add_argument("--variant", action="append", default=None)
    p.add_argument("--top", type=int, default=8)
    p.add_argument("--timeout", type=int, default=240)
    p.add_argument("--who", default="FillFunctor|Memcpy DtoD", help="which GPU events to trace to their host op")
    p.add_argument("--recipe", default="imagefolder", help="a recipe file's name too (run in --cwd)")
    p.add_argument("--cwd", default=None, help="where launch runs (a recipe file's folder); default a scratch dir")
    p.add_argument("--epochs", type=int, default=3, help="the second is profiled; the third is not")
    p.add_argument("--gpus", default="[0]", help="launch's gpus= (rank 0 is profiled); a variant sets batch_size")
    args = p.parse_args()
    for variant in args.variant or ["data.decode=auto"]:
        with tempfile.TemporaryDirectory(prefix="if-profile-") as scratch:
            run_dir = Path(scratch) / "run"
            cmd = [sys.executable, "-m", "launcher", f"recipe={args.recipe}", f"data.root={args.root}",
                   f"gpus={args.gpus}", "perf.compile=true", "eval.every=0", f"epochs={args.epochs}", "profile=true",
                   f"hydra.run.dir={run_dir}", *variant.split()]
            try:
                proc = subprocess.run(cmd, cwd=args.cwd or scratch, capture_output=True, text=True,
                                      timeout=args.timeout)
                code, text = proc.returncode, proc.stdout + proc.stderr
            except subprocess.TimeoutExpired as exc:
                code, text = "timeout", str(exc.stdout or "") + str(exc.stderr or "")
            row: dict = {"variant": variant, "exit_code": code,
                         "epoch_lines": [ln.strip()[-160:] for ln in text.splitlines() if "epoch" in ln
                                         and "images/s" in ln][-3:]}
            trace = run_dir / "trace.json"
            if trace.exists():
                row.update(analyse(json.loads(trace.read_text()), args.top, args.who))
            else:
                row["output_tail"] = text[-1500:]
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
