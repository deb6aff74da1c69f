"""Does this host keep Python bytecode, and what do imports cost with and without it? JSON lines.

    python bench/probe/bytecode.py

Each timing is a fresh interpreter. `cached` runs use a PYTHONPYCACHEPREFIX that the first of them
fills, so they show what a bytecode cache would give on a host that keeps none beside the sources.
"""
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

IMPORTS = {"torch": "import torch", "torch+dynamo": "import torch, torch._dynamo", "hydra": "import hydra, omegaconf"}


def seconds(code: str, env: dict) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True, env=env)
    return round(time.perf_counter() - start, 2)


def main() -> None:
    torch_dir = Path(torch.__file__).parent
    print(json.dumps({"what": "bytecode_facts", "PYTHONDONTWRITEBYTECODE": os.environ.get("PYTHONDONTWRITEBYTECODE"),
                      "dont_write_bytecode": sys.flags.dont_write_bytecode,
                      "torch_pyc_files": sum(1 for _ in torch_dir.rglob("*.pyc")),
                      "torch_dir_writable": os.access(torch_dir, os.W_OK), "python": sys.version.split()[0]}),
          flush=True)
    prefix = tempfile.mkdtemp(prefix="pycache-probe-")
    plain = dict(os.environ)
    cached = {**os.environ, "PYTHONPYCACHEPREFIX": prefix}
    cached.pop("PYTHONDONTWRITEBYTECODE", None)
    for name, code in IMPORTS.items():
        row = {"what": "import_seconds", "modules": name,
               "as_is": [seconds(code, plain), seconds(code, plain)],
               "cache_filling": seconds(code, cached), "cached": [seconds(code, cached), seconds(code, cached)]}
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
