"""recipe=text's GPT through `launch` against a plain nanoGPT-style script, and fsdp's memory against ddp's (issue 16).

    python bench/gpt.py compare                  # GPT-2-small shape (12 x 768, 12 heads, context 1024), 1 and 2 GPUs
    python bench/gpt.py compare --gpus 1         # one GPU only
    python bench/gpt.py compare --gpus 1 --shards '/tmp/shards/*.bin'   # GPT-2 tokens (vocabulary 50257 -> 50304):
                                                 # bench/make_token_shards.py writes such shards
    python bench/gpt.py memory                   # 2 GPUs: peak memory per GPU, ddp vs fsdp, same model and batch
    python bench/gpt.py memory --layers 42 --width 4096 --heads 32 --context 512 --batch-per-gpu 1 --meta-init
                                                 # ~8.5B parameters: fsdp trains, ddp runs out of memory

`compare` runs, in one call, `launch recipe=text` (ddp on 2 GPUs, single on 1; perf.compile=true) and
bench/gpt_script.py under torchrun (DDP + torch.compile, the same model, batch, bf16 and AdamW) on the
stdlib corpus; tokens/s is the device clock of the slowest rank, the mean over epochs 2..E of --steps
steps each, on both sides (the script's first window, like launch's first epoch, holds compilation),
MFU from the model's FLOPs per token, peak memory a GPU over the timed epochs (the first beside it, as the script
resets its count after its first window). One JSON line per run, then a summary.
`memory` launches the same model under ddp and fsdp on 2 GPUs and reports each one's peak allocated
memory per GPU (max over ranks and the timed epochs; the first's beside it) and exit code; an
out-of-memory run reports the launcher's one-line message.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
from launch_run import run_launch  # noqa: E402


def corpus(root: Path) -> Path:
    from launcher.data.corpus import Corpus

    return Corpus("stdlib", root, synthetic=False).ensure() / "train.bin"


def model_args(a: argparse.Namespace) -> list[str]:
    return [f"recipe.layers={a.layers}", f"recipe.width={a.width}", f"recipe.heads={a.heads}",
            f"recipe.context={a.context}"]


def launch_gpt(a: argparse.Namespace, gpus: int, strategy: str, root: Path, extra: tuple[str, ...] = ()) -> dict:
    steps = a.steps
    batch = a.batch_per_gpu * gpus
    max_bytes = steps * batch * a.context * 20 // 19 + 4 * a.context * 20  # steps per epoch, and a held-out part
    if a.shards:  # (an epoch is the shards' windows: steps are what they hold)
        data = [f"recipe.corpus={a.shards}", f"recipe.vocab_size={a.vocab_size}"]
    else:
        data = [f"recipe.max_bytes={max_bytes}"]
    run = run_launch("recipe=text", f"gpus=[{','.join(map(str, range(gpus)))}]", f"strategy={strategy}",
                     *model_args(a), f"batch_size={batch}", *data, f"epochs={a.epochs}",
                     "recipe.sample_bytes=0", "eval.every=0", f"data.root={root}", "progress=lines", *extra,
                     timeout=a.timeout)
    record = {"what": "launch", "strategy": strategy, "gpus": gpus, "args": list(extra), "exit_code": run.exit_code,
              "wall_s": run.wall_s}
    if not run.ok:  # (a run stopped by --timeout: the epochs it finished and its log's last lines)
        return {**record, "error": run.error_tail(45 if run.exit_code == 124 else 3),
                "per_epoch": [[round(x["tokens_per_s"]), x.get("host_issue_s"), round(x["train_s"], 4)]
                              for x in run.metrics]}
    rows = run.metrics[1:] or run.metrics
    r = run.results
    record["cuda_graph"] = run.said("perf.cuda_graph=auto")
    return {**record, "tokens_per_s": round(sum(x["tokens_per_s"] for x in rows) / len(rows)),
            "mfu": round(sum(x.get("mfu") or 0 for x in rows) / len(rows), 4), "parameters": r["parameters"],
            # (the timed epochs' peak, as the script resets its count after its first, compiling window;
            # the first epoch's, compile included, beside it)
            "max_mem_allocated_mb": max(x["max_mem_allocated_mb"] or 0 for x in rows),
            "first_epoch_mem_allocated_mb": run.metrics[0]["max_mem_allocated_mb"],
            "compiled": r["compiled"], "steps_per_epoch": steps,
            "per_epoch": [[round(x["tokens_per_s"]), x.get("host_issue_s"), round(x["train_s"], 4),
                           x.get("checkpoint_wait_s"), x.get("checkpoint_write_s")]
                          for x in run.metrics], "device": (r["devices"] or [None])[0],
            "torch": r["torch"]}


def script_gpt(a: argparse.Namespace, gpus: int, stream: Path, loss: str = "inside") -> dict:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={gpus}",
               str(HERE / "gpt_script.py"), *(["--shards", a.shards, "--vocab-size", str(a.vocab_size)] if a.shards
                                              else ["--stream", str(stream)]), "--layers", str(a.layers), "--width",
               str(a.width), "--heads", str(a.heads), "--context", str(a.context), "--batch-per-gpu",
               str(a.batch_per_gpu), "--steps", str(a.steps), "--epochs", str(a.epochs), "--loss", loss]
    start = time.perf_counter()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(command, capture_output=True, text=True, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"what": "script", "gpus": gpus, "loss_where": loss, "exit_code": proc.returncode,
                "error": (proc.stderr or proc.stdout).strip().splitlines()[-3:]}
    return {**json.loads(lines[-1]), "what": "script", "gpus": gpus, "exit_code": 0,
            "wall_s": round(time.perf_counter() - start, 2)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["compare", "memory"])
    parser.add_argument("--gpus", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--batch-per-gpu", type=int, default=16)
    parser.add_argument("--steps", type=int, default=40, help="steps per epoch (launch) / timed steps (script)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--meta-init", action="store_true")
    parser.add_argument("--root", default=None, help="data.root (default: a temporary folder)")
    parser.add_argument("--launch-args", nargs="*", default=[], help="more KEY=VALUE overrides for the launch runs")
    parser.add_argument("--no-script", action="store_true", help="compare: run launch only")
    parser.add_argument("--strategy", default=None, help="compare: launch's strategy (default: single on 1 GPU, ddp)")
    parser.add_argument("--shards", default=None, help="a glob of token shards instead of the stdlib bytes")
    parser.add_argument("--vocab-size", type=int, default=50257)
    parser.add_argument("--timeout", type=float, default=None,
                        help="seconds a launch run may take; past them it is stopped and reported as it stood")
    parser.add_argument("--script-loss", nargs="+", default=["inside", "outside"], choices=["inside", "outside"],
                        help="compare: the script's loss in its compiled forward (nanoGPT's way), after it, or both "
                             "(launch is compared with the faster)")
    a = parser.parse_args()
    root = Path(a.root or tempfile.mkdtemp(prefix="bench-gpt-"))
    stream = corpus(root)
    if a.mode == "compare":
        best: dict[str, dict[int, float]] = {"launch": {}, "script": {}}
        for gpus in a.gpus:
            runs = [("launch", "")] + ([] if a.no_script else [("script", loss) for loss in a.script_loss])
            for what, loss in runs:
                record = (launch_gpt(a, gpus, a.strategy or ("single" if gpus == 1 else "ddp"), root,
                                     ("perf.compile=true", *a.launch_args)) if what == "launch"
                          else script_gpt(a, gpus, stream, loss))
                print(json.dumps(record), flush=True)
                if record.get("tokens_per_s"):  # (the script's best way counts)
                    best[record["what"]][gpus] = max(best[record["what"]].get(gpus, 0), record["tokens_per_s"])
        summary = {"what": "summary", **{f"{k}_{g}gpu": v for k, d in best.items() for g, v in d.items()}}
        for g in a.gpus:
            if best["launch"].get(g) and best["script"].get(g):
                summary[f"launch_over_script_{g}gpu"] = round(best["launch"][g] / best["script"][g], 3)
        if best["launch"].get(2) and best["launch"].get(1):
            summary["launch_2gpu_over_1gpu"] = round(best["launch"][2] / best["launch"][1], 3)
        print(json.dumps(summary), flush=True)
    else:
        meta = ("strategy.meta_init=true",) if a.meta_init else ()
        for strategy, extra in (("ddp", ("perf.compile=false",)), ("fsdp", meta)):
            print(json.dumps(launch_gpt(a, 2, strategy, root, (*extra, *a.launch_args))), flush=True)


if __name__ == "__main__":
    main()
