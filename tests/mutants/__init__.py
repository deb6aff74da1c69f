"""Mutation check: one-line bugs planted in the launcher's code, each with the tests that must notice it.

Each mutant is a one-line change of the kind "a user gets a wrong result silently" (a wrong figure, a wrong
file kept or removed, a wrong exit code); it is *caught* when the tests it names fail with it in place. Every
module of launcher/train, launcher/data, launcher/host, launcher/strategies and recipes/ has at least two
(tests/unit/test_mutants.py checks that, and that every mutant's line is still in its file exactly once),
except the few in EXEMPT, which hold no statement that computes anything.

    python -m tests.mutants                     # every mutant: one JSON line each, then a summary line
    python -m tests.mutants atomic idle         # only the mutants whose name or file contains one of these words
    python -m tests.mutants --list              # the mutants and the modules they cover, nothing run
    python -m tests.mutants --shard 1/2         # every second mutant (two checkouts, each its own venv, side by side)
    python -m tests.mutants --no-baseline       # no baseline run: only where the whole suite passed at this commit
    python -m tests.mutants --skip done.jsonl   # leave out the mutants an earlier run's JSON lines report

Before the mutants, the tests they name are run once on the unchanged code (all in one pytest; set by set
only if that fails): a mutant whose tests fail without it proves nothing and is reported as `"caught": null`
with the baseline's failure.

It edits the working tree in place (launcher/ and recipes/ are installed in editable mode, so a copy would
not be what the tests import): run it on a clean checkout, with nothing else running tests. The file is
restored after each mutant, whatever happens.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCOPE = ("launcher/train", "launcher/data", "launcher/host", "launcher/strategies", "recipes")
MIN_PER_MODULE = 2
TIMEOUT_S = 900

# Modules in SCOPE that compute nothing a mutant could change: why, in one line each.
EXEMPT = {
    "launcher/train/__init__.py": "a docstring only (the wing's module list)",
    "launcher/data/__init__.py": "a docstring only (the wing's module list)",
    "launcher/host/__init__.py": "a docstring only (the wing's module list)",
    "launcher/host/backends/base.py": "an abstract interface: three abstract methods and no bodies",
    "launcher/host/hydra_plugins/launcher_sweep/__init__.py":
        "a name for sweep_launcher.SweepLauncher under hydra_plugins, no body (its mutants are sweep_launcher's)",
}

UNIT_CKPT = "tests/unit/test_checkpoint_and_env.py"
UNIT_PLAN = "tests/unit/test_plan.py"
UNIT_COMPILE = "tests/unit/test_compile_and_cache.py"


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str  # relative to the repository
    old: str  # text that occurs exactly once in the file
    new: str
    tests: tuple[str, ...]  # pytest node ids that must fail with the mutant in place


def all_mutants() -> list[Mutant]:
    from tests.mutants import host, recipes, shared, strategies, train

    return [*train.MUTANTS, *host.MUTANTS, *strategies.MUTANTS, *recipes.MUTANTS, *shared.MUTANTS]


def modules_in_scope() -> list[str]:
    return sorted(str(p.relative_to(REPO)) for top in SCOPE for p in (REPO / top).rglob("*.py"))


def _pytest(tests: tuple[str, ...]) -> subprocess.CompletedProcess:
    try:
        return subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests],
                              cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return subprocess.CompletedProcess(exc.cmd, 124, out + f"\n(timed out after {TIMEOUT_S} s)", "")


def _tail(proc: subprocess.CompletedProcess) -> str:
    return (proc.stdout.strip().splitlines() or [""])[-1]


def run(mutant: Mutant) -> dict:
    path = REPO / mutant.path
    original = path.read_text()
    if original.count(mutant.old) != 1:
        return {"mutant": mutant.name, "file": mutant.path, "caught": None,
                "error": f"the line is not in {mutant.path} exactly once"}
    started = time.monotonic()
    try:
        path.write_text(original.replace(mutant.old, mutant.new))
        proc = _pytest(mutant.tests)
    finally:
        path.write_text(original)
    # (a time-out decides nothing: a loaded machine, not the mutant, may have slowed the tests)
    caught = None if proc.returncode == 124 else proc.returncode != 0
    return {"mutant": mutant.name, "file": mutant.path, "caught": caught, "tests": _tail(proc),
            "seconds": round(time.monotonic() - started, 1)}


def _baseline(sets: list[tuple[str, ...]]) -> dict[tuple[str, ...], subprocess.CompletedProcess]:
    """Each set of tests, run on the unchanged code. All of them in one pytest first (one start-up, not
    hundreds); only when that fails is each set run alone, so a failing test marks the sets that hold it."""
    entries = list(dict.fromkeys(t for tests in sets for t in tests))
    files = {e for e in entries if "::" not in e}
    union = [e for e in entries if e in files or e.split("::")[0] not in files]
    try:
        whole = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *union], cwd=REPO,
                               capture_output=True, text=True, timeout=TIMEOUT_S * 6)
    except subprocess.TimeoutExpired:
        whole = subprocess.CompletedProcess([], 124, "", "")
    print(json.dumps({"baseline": f"{len(union)} test arguments for {len(sets)} sets", "tests": _tail(whole)}),
          flush=True)
    baseline = {}
    for tests in sets:
        baseline[tests] = whole if whole.returncode == 0 else _pytest(tests)
        if baseline[tests].returncode != 0:
            print(json.dumps({"baseline_failed": list(tests), "tests": _tail(baseline[tests])}), flush=True)
    return baseline


def _imported_from_elsewhere() -> str | None:
    """Why the tests would not import this checkout's code, if they would not: a mutant edits files here, and
    one another checkout's editable install maps (recipes/ is `launcher.recipes` through the install's
    package map, which PYTHONPATH does not change) was run unmutated: 24 mutants then seemed to survive."""
    import importlib.util

    for name in ("launcher", "launcher.recipes"):
        spec = importlib.util.find_spec(name)
        origin = Path(spec.origin).resolve() if spec and spec.origin else None
        if origin is None or not origin.is_relative_to(REPO):
            return (f"{name} is imported from {origin}, not from this checkout ({REPO}); install this checkout in "
                    f"a venv of its own (python -m venv .venv && .venv/bin/pip install -e '.[dev]')")
    return None


def main(argv: list[str]) -> int:
    mutants = all_mutants()
    if "--list" in argv:
        for m in mutants:
            print(f"{m.path}: {m.name}")
        return 0
    shard = None
    if "--shard" in argv:
        at = argv.index("--shard")
        index, count = (int(n) for n in argv[at + 1].split("/"))
        shard, argv = (index - 1, count), argv[:at] + argv[at + 2:]
    done: set[str] = set()
    if "--skip" in argv:  # an earlier run's output: its mutants (caught or not) are not run again
        at = argv.index("--skip")
        for line in Path(argv[at + 1]).read_text().splitlines():
            row = json.loads(line) if line.startswith("{") else {}
            if "mutant" in row and row.get("caught") is not None:
                done.add(row["mutant"])
        argv = argv[:at] + argv[at + 2:]
    no_baseline = "--no-baseline" in argv
    words = [w.lower() for w in argv if w != "--no-baseline"]
    chosen = [m for m in mutants if not words or any(w in m.name.lower() or w in m.path for w in words)]
    if shard is not None:
        chosen = chosen[shard[0]::shard[1]]
    chosen = [m for m in chosen if m.name not in done]
    if not chosen:
        print(f"mutants: no mutant left to run whose name or file holds {' or '.join(words) or 'anything'} "
              "(python -m tests.mutants --list shows them)", file=sys.stderr)
        return 2
    imported = _imported_from_elsewhere()
    if imported:
        print(f"mutants: {imported}", file=sys.stderr)
        return 2
    dirty = subprocess.run(["git", "status", "--porcelain", "--", *sorted({m.path for m in chosen})], cwd=REPO,
                           capture_output=True, text=True).stdout.strip()
    if dirty:
        print(f"mutants: these files have uncommitted changes; commit or stash them first:\n{dirty}", file=sys.stderr)
        return 2
    if no_baseline:  # the whole suite has just passed at this commit: it is the baseline
        passed = subprocess.CompletedProcess([], 0, "", "")
        baseline = {m.tests: passed for m in chosen}
    else:
        baseline = _baseline(list(dict.fromkeys(m.tests for m in chosen)))
    caught = 0
    survivors = []
    for mutant in chosen:
        if baseline[mutant.tests].returncode != 0:
            row = {"mutant": mutant.name, "file": mutant.path, "caught": None,
                   "error": "its tests fail without it: " + _tail(baseline[mutant.tests])}
        else:
            row = run(mutant)
        caught += bool(row["caught"])
        if not row["caught"]:
            survivors.append(mutant.name)
        print(json.dumps(row), flush=True)
    print(json.dumps({"caught": caught, "of": len(chosen), "not_caught": survivors}))
    return 0 if caught == len(chosen) else 1
