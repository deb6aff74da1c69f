"""The scripts in bench/ back the rows of BENCHMARKS.md: each must still import against the launcher as it is
now (a script that imports a moved internal fails here, not on the device machine), and each shell script must
parse. Importing runs no benchmark: every script keeps its work under `if __name__ == "__main__":`."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench"
SCRIPTS = sorted(p.stem for p in BENCH.glob("*.py"))
SHELL = sorted(BENCH.glob("*.sh"))


def test_bench_holds_the_scripts_benchmarks_cites():
    backing = {"peers", "torchrun_ddp", "gpt", "gpt_script", "imagefolder", "imagefolder_ddp", "fast_recipe"}
    assert backing <= set(SCRIPTS)
    cited = set(re.findall(r"\bbench/([a-z0-9_]+\.(?:py|sh))\b", (REPO / "BENCHMARKS.md").read_text()))
    missing = sorted(name for name in cited if not (BENCH / name).exists())
    assert not missing, f"BENCHMARKS.md cites bench/ scripts that are not in the tree: {missing}"


def test_every_bench_script_imports():
    code = ("import importlib, sys\n"
            f"sys.path.insert(0, {str(BENCH)!r})\n"
            f"for name in {SCRIPTS!r}:\n"
            "    importlib.import_module(name)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]


@pytest.mark.parametrize("script", SHELL, ids=[p.name for p in SHELL])
def test_every_bench_shell_script_parses(script):
    out = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
