"""Where the seconds before a worker's first line go: the launcher's steps beside the forkserver's
preload (launcher/train/preload.py), for `launch recipe=cifar10 gpus=[0] data.synthetic=true epochs=1`
run in this process (cli.main) with timestamps added around its steps.

    python bench/probe/startup_trace.py [--runs 3] [overrides...]      # one JSON line per run

Marks (seconds after cli.main was called): Hydra's composed config reaching the task function
(`composed`), the recipe module imported (`recipe_imported`, which imports torch in the launcher),
the plan made, the launcher's elastic_launch called (`spawn`), elastic asking for the worker processes
(`start_processes`), and in the forkserver its preload's first and last line (`preload_begin`,
`preload_end`); then the worker's own timeline from results.json (worker_process, ..., first_step).
The workers are forks of the forkserver, so `worker_process` cannot come before `preload_end`: which
of `start_processes` and `preload_end` is later says what the first worker waited for.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path


def child(overrides: list[str], marks_path: Path) -> None:
    marks_dir = marks_path.parent
    for name in ("startup_mark_begin", "startup_mark_end"):  # modules the forkserver imports around the preload
        label = name.removeprefix("startup_mark_")
        (marks_dir / f"{name}.py").write_text(textwrap.dedent(f"""
            import json, os, time
            row = {{"mark": {label!r}, "t": time.time(), "pid": os.getpid()}}
            with open({str(marks_path)!r}, "a") as f:
                f.write(json.dumps(row) + "\\n")
        """))
    sys.path.insert(0, str(marks_dir))

    def mark(name: str) -> None:
        with open(marks_path, "a") as f:
            f.write(json.dumps({"mark": name, "t": time.time()}) + "\n")

    import multiprocessing

    real_preload = multiprocessing.set_forkserver_preload
    multiprocessing.set_forkserver_preload = lambda names: real_preload(
        ["startup_mark_begin", *names, "startup_mark_end"])

    from launcher.host import cli, run_here

    def wrap(owner, attr, name, before=False):
        real = getattr(owner, attr)

        def wrapped(*a, **k):
            if before:
                mark(name)
            out = real(*a, **k)
            if not before:
                mark(name)
            return out
        setattr(owner, attr, wrapped)

    wrap(cli.Invocation, "run_job", "composed", before=True)
    wrap(run_here, "check_runnable", "recipe_imported")
    wrap(run_here, "make_plan", "plan_made")

    import launcher.host.spawn as spawn

    real_launch_local = spawn.launch_local

    def launch_local(*a, **k):
        mark("spawn")
        import torch.distributed.elastic.agent.server.local_elastic_agent as lea

        real_start = lea.start_processes

        def start_processes(*aa, **kk):
            mark("start_processes")
            return real_start(*aa, **kk)
        lea.start_processes = start_processes
        return real_launch_local(*a, **k)
    spawn.launch_local = launch_local
    mark("main")
    try:
        cli.main(overrides)
    except SystemExit:
        pass


def one_run(overrides: list[str], scratch: Path, env: dict[str, str]) -> dict:
    marks = scratch / "marks.jsonl"
    marks.unlink(missing_ok=True)
    run_dir = scratch / f"run-{time.time_ns()}"
    started = time.time()
    proc = subprocess.run([sys.executable, __file__, "--child", str(marks), f"hydra.run.dir={run_dir}", *overrides],
                          capture_output=True, text=True, env=env, cwd=scratch)
    wall = time.time() - started
    if proc.returncode != 0:
        return {"what": "startup_trace", "exit_code": proc.returncode, "error": (proc.stdout + proc.stderr)[-2000:]}
    rows = [json.loads(x) for x in marks.read_text().splitlines()]
    t0 = next(r["t"] for r in rows if r["mark"] == "main")
    out = {r["mark"]: round(r["t"] - t0, 3) for r in rows}
    results = json.loads((run_dir / "results.json").read_text())
    timeline = results.get("startup") or {}
    # the worker's timeline counts from cli.main's `started` (a few ms after `main`)
    return {"what": "startup_trace", "launcher_and_forkserver": out, "worker": timeline,
            "python_start_to_main_s": round(t0 - started, 3), "wall_s": round(wall, 3),
            "device": (results.get("devices") or ["cpu"])[0], "torch": results.get("torch"),
            "overrides": overrides, "date": time.strftime("%Y-%m-%d")}


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        child(sys.argv[3:], Path(sys.argv[2]))
        return
    args = sys.argv[1:]
    runs = 3
    if args[:1] == ["--runs"]:
        runs, args = int(args[1]), args[2:]
    overrides = args or ["recipe=cifar10", "gpus=[0]", "data.synthetic=true", "epochs=1"]
    with tempfile.TemporaryDirectory(prefix="startup-trace-") as scratch:
        env = {**os.environ, "LAUNCH_CACHE_DIR": str(Path(scratch) / "cache")}
        for _ in range(runs):  # the first fills the data and compile caches
            print(json.dumps(one_run(overrides, Path(scratch), env)), flush=True)


if __name__ == "__main__":
    main()
