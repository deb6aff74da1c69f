"""An opt-in pytest plugin: the CPU seconds each test cost, for finding what makes the suite slow on few cores.

    python -m pytest -q -n 3 -p tests.cpu_report       # writes cpu-report.jsonl here (LAUNCH_CPU_REPORT=path)

One JSON line per test: {"id", "worker", "start" (epoch seconds), "wall", "self", "children", "warm"}:
seconds of wall clock, of this pytest process's CPU, of the processes it started and reaped (cold launches,
`ip netns exec`, helper scripts), and of the launches the warm launcher forked for it (tests/warm.py reports
each one's CPU with its exit status). What neither reaps (a SLURM job's processes, a server a fixture keeps
for the session) is counted where it ends, if at all: a line whose CPU is far above its wall clock is such
a reaping, not the test."""

from __future__ import annotations

import json
import os
import resource
import time

import pytest


def _spent() -> tuple[float, float, float]:
    me, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    import tests.warm

    return (me.ru_utime + me.ru_stime, children.ru_utime + children.ru_stime, tests.warm.CPU_SPENT)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    before, start, started = _spent(), time.monotonic(), time.time()
    yield
    after = _spent()
    row = {"id": item.nodeid, "worker": os.environ.get("PYTEST_XDIST_WORKER", ""), "start": round(started, 3),
           "wall": round(time.monotonic() - start, 3),
           **{key: round(b - a, 3) for key, a, b in zip(("self", "children", "warm"), before, after, strict=True)}}
    with open(os.environ.get("LAUNCH_CPU_REPORT", "cpu-report.jsonl"), "a") as report:
        report.write(json.dumps(row) + "\n")
