"""What a checkpoint's seal (launcher/integrity.py) costs: the save of a large checkpoint with and without
it, and the check when a user names it (resume=, launch eval, launch export).

    python bench/checkpoint_seal.py --mb 1024 --repeats 3

One JSON line per measurement, then a summary line. The state is shaped like a training checkpoint: the
weights, two optimizer moments of the same size (AdamW), a schedule and the config. Written to --dir
(default: a temporary folder under /tmp) with launch's own atomic, fsynced write; the page cache is left
as it is (a save right after training finds the tensors in memory, and the check reads a file just saved
or long cold: both are reported as the machine gives them).
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch

from launcher import integrity
from launcher.host import resume
from launcher.train import checkpoint


def state_of(mb: int) -> dict:
    per_tensor = 4 << 20  # 4 MB tensors, as a model's layers
    count = max(1, (mb << 20) // 3 // per_tensor)
    weights = {f"layer{i}.weight": torch.randn(per_tensor // 4) for i in range(count)}
    moments = [{"exp_avg": torch.randn(per_tensor // 4), "exp_avg_sq": torch.rand(per_tensor // 4),
                "step": torch.tensor(100.0)} for _ in range(count)]
    return {"net_state_dict": weights, "optimizer_state_dicts": [{"state": dict(enumerate(moments)),
            "param_groups": [{"lr": 1e-3, "params": list(range(count))}]}], "epoch": 3, "history": [],
            "config": {"recipe": {"name": "bench"}, "optim": {"name": "adamw"}}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="seal-bench-", dir=args.dir))
    state = state_of(args.mb)
    size = sum(t.numel() * t.element_size() for t in checkpoint._tensors(state))
    rows = []
    try:
        for repeat in range(args.repeats):
            for sealed in (False, True):
                path = root / f"run-{repeat}-{sealed}" / "checkpoints" / "last.pt"
                original = integrity.seal
                if not sealed:
                    integrity.seal = lambda s, run, folder=None: s  # (the save as it was before seals)
                try:
                    started = time.perf_counter()
                    checkpoint.save_atomic(dict(state), path)
                    save_s = time.perf_counter() - started
                finally:
                    integrity.seal = original
                row = {"what": "save", "sealed": sealed, "repeat": repeat, "bytes": size, "seconds": round(save_s, 3)}
                if sealed:
                    started = time.perf_counter()
                    integrity.state_digest(state)
                    row["digest_seconds"] = round(time.perf_counter() - started, 3)  # (the seal's own work)
                    resume._checked.clear()
                    started = time.perf_counter()
                    resume.load_checkpoint(path, "resume")
                    row["check_seconds"] = round(time.perf_counter() - started, 3)
                rows.append(row)
                print(json.dumps(row), flush=True)
                shutil.rmtree(path.parent.parent)
        plain = sorted(r["seconds"] for r in rows if not r["sealed"])
        sealed = sorted(r["seconds"] for r in rows if r["sealed"])
        checks = sorted(r["check_seconds"] for r in rows if r["sealed"])
        digests = sorted(r["digest_seconds"] for r in rows if r["sealed"])
        print(json.dumps({"summary": True, "bytes": size, "torch": torch.__version__,
                          "save_s_median": plain[len(plain) // 2], "sealed_save_s_median": sealed[len(sealed) // 2],
                          "ratio": round(sealed[len(sealed) // 2] / plain[len(plain) // 2], 3),
                          "digest_s_median": digests[len(digests) // 2], "check_s_median": checks[len(checks) // 2]}))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
