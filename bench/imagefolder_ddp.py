"""recipe=imagefolder on one and two GPUs (issue 36): `launch` against torchvision's ImageFolder + DataLoader +
DDP under torchrun, the same folder, model, batch per GPU and DataLoader workers in total.

    python bench/imagefolder_ddp.py compare --root /tmp/imagenet-gen        (20,000 JPEGs generated if missing)
    python bench/imagefolder_ddp.py compare --gpus 2 --only baseline        (one side only)
    torchrun --standalone --nproc-per-node=2 bench/imagefolder_ddp.py baseline --root /tmp/imagenet-gen --workers 15
    python bench/imagefolder_ddp.py compare --device cpu --n 96 --classes 4 --batch-per-gpu 4 --size 32 \\
        --model resnet18 --epochs 2 --root /tmp/if-ddp     (the script itself checked on a CPU, gloo: no timing claims)

`compare` runs, one after the other:
  launch     `launch recipe=imagefolder` on 1 GPU and on 2 (ddp), perf.compile=true, eval.every=0, its
             defaults otherwise (data.decode=auto, data.workers: the cores per rank less one). img/s: the
             mean of the per-epoch figures in metrics.jsonl over epochs 2..E (the device clock of each epoch,
             its start included: the GPU idle while the first batches are read counts)
  baseline   this file under torchrun: torchvision's ImageFolder, PIL RandomResizedCrop + flip + ToTensor +
             Normalize in the workers (torchvision's reference recipe), DistributedSampler, DataLoader
             (pin_memory, persistent workers, prefetch_factor 4), DDP (gradient_as_bucket_view),
             torch.compile, bf16 autocast, channels_last, SGD with Nesterov momentum. img/s: the global
             images of epochs 2..E over their wall-clock time on rank 0 (each epoch ends with a device sync)
  with as many workers in total on each side as launch gives its ranks. One JSON line per run, then a summary.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))


def launch_run(a: argparse.Namespace, gpus: int) -> dict:
    from launch_run import run_launch

    devices = f"gpus=[{','.join(map(str, range(gpus)))}]" if a.device == "cuda" else "gpus=[]"
    extra = [] if a.device == "cuda" else [f"nprocs={gpus}", "data.workers=1"]
    strategy = "single" if gpus == 1 else "ddp"
    run = run_launch("recipe=imagefolder", f"data.root={a.root}", devices, f"strategy={strategy}", *extra,
                     f"recipe.model={a.model}", f"recipe.image_size={a.size}", f"batch_size={a.batch_per_gpu * gpus}",
                     f"epochs={a.epochs}", f"perf.compile={str(a.compile).lower()}", "eval.every=0",
                     "progress=lines", *a.launch_args)
    record = {"what": "launch", "gpus": gpus, "exit_code": run.exit_code, "wall_s": run.wall_s,
              "args": a.launch_args}
    if not run.ok:
        return {**record, "error": run.error_tail(6)}
    rows = run.metrics[1:] or run.metrics
    workers = next((line for line in run.output.splitlines() if line.startswith("data: ")), "")
    decode = next((line for line in run.output.splitlines() if line.startswith("data.decode")), "")
    kept, graph = run.said("data.decode=auto: kept"), run.said("perf.cuda_graph=auto")
    return {**record, "cuda_graph": graph, "img_per_s": round(sum(r["images_per_s"] for r in rows) / len(rows), 1),
            "per_epoch": [[round(r["images_per_s"]), r.get("input_stall"), r.get("host_issue_s"),
                           round(r["train_s"], 3), r.get("checkpoint_wait_s"), r.get("checkpoint_write_s")]
                          for r in run.metrics],
            "workers": workers.split("samples, ")[-1], "decode": decode[:120], "kept": kept[:400],
            "device": (run.results["devices"] or [None])[0], "torch": run.results["torch"]}


def baseline_run(a: argparse.Namespace, gpus: int, workers_per_rank: int) -> dict:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={gpus}",
               str(Path(__file__).resolve()), "baseline", "--root", str(a.root), "--model", a.model, "--size",
               str(a.size), "--batch-per-gpu", str(a.batch_per_gpu), "--epochs", str(a.epochs), "--workers",
               str(workers_per_rank), "--device", a.device, *([] if a.compile else ["--no-compile"])]
    start = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"what": "baseline", "gpus": gpus, "exit_code": proc.returncode,
                "error": (proc.stderr or proc.stdout).strip().splitlines()[-6:]}
    return {**json.loads(lines[-1]), "what": "baseline", "gpus": gpus, "exit_code": 0,
            "wall_s": round(time.perf_counter() - start, 1)}


def baseline(a: argparse.Namespace) -> None:
    """One rank of the torchrun baseline."""
    import torch
    import torch.distributed as dist
    import torchvision
    from torchvision import datasets
    from torchvision.transforms import v2

    from launcher.data.images import MEAN, STD

    cuda = a.device == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
        torch.backends.cudnn.benchmark = True
    tf = v2.Compose([v2.RandomResizedCrop(a.size, antialias=True), v2.RandomHorizontalFlip(), v2.ToImage(),
                     v2.ToDtype(torch.float32, scale=True),
                     v2.Normalize([m / 255 for m in MEAN], [s / 255 for s in STD])])
    ds = datasets.ImageFolder(str(Path(a.root) / "train"), transform=tf)
    sampler = torch.utils.data.distributed.DistributedSampler(ds, shuffle=True, seed=0, drop_last=True)
    loader = torch.utils.data.DataLoader(ds, batch_size=a.batch_per_gpu, sampler=sampler, drop_last=True,
                                         num_workers=a.workers, pin_memory=cuda, persistent_workers=a.workers > 0,
                                         prefetch_factor=4 if a.workers else None)
    model = torchvision.models.get_model(a.model, weights=None, num_classes=len(ds.classes)).to(device)
    if cuda:
        model = model.to(memory_format=torch.channels_last)
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[local] if cuda else None,
                                                    gradient_as_bucket_view=True)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-5, nesterov=True,
                          **({"fused": True} if cuda else {}))
    net = torch.compile(ddp) if a.compile else ddp
    loss_fn = torch.nn.CrossEntropyLoss(label_smoothing=0.1)
    timed_images, timed_s, per_epoch = 0, 0.0, []
    for epoch in range(a.epochs):
        sampler.set_epoch(epoch)
        dist.barrier()
        start = time.perf_counter()
        steps = 0
        for x, y in loader:
            x = x.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True)
            if cuda:
                x = x.contiguous(memory_format=torch.channels_last)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
                loss = loss_fn(net(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            steps += 1
        if cuda:
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - start
        images = steps * a.batch_per_gpu * world
        per_epoch.append(round(images / seconds, 1))
        if epoch > 0:
            timed_images, timed_s = timed_images + images, timed_s + seconds
    if rank == 0:
        print(json.dumps({"img_per_s": round(timed_images / timed_s, 1) if timed_s else None,
                          "per_epoch": per_epoch, "workers_per_rank": a.workers, "ranks": world,
                          "device": torch.cuda.get_device_name(device) if cuda else "cpu",
                          "torch": torch.__version__}), flush=True)
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["compare", "baseline"])
    p.add_argument("--root", default="/tmp/imagenet-gen")
    p.add_argument("--n", type=int, default=20_000)
    p.add_argument("--classes", type=int, default=100)
    p.add_argument("--device", default="cuda")
    p.add_argument("--gpus", type=int, nargs="+", default=[1, 2])
    p.add_argument("--model", default="resnet50")
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--batch-per-gpu", type=int, default=256)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--workers", type=int, default=None, help="baseline: workers per rank (compare: launch's)")
    p.add_argument("--no-compile", dest="compile", action="store_false")
    p.add_argument("--only", default="launch,baseline")
    p.add_argument("--launch-args", nargs="*", default=[], help="more KEY=VALUE overrides for the launch runs")
    a = p.parse_args()
    if a.mode == "baseline":
        baseline(a)
        return
    from imagefolder import make_folder

    make_folder(Path(a.root), a.n, a.classes)
    cores = len(os.sched_getaffinity(0))
    best: dict[str, dict[int, float]] = {"launch": {}, "baseline": {}}
    for gpus in a.gpus:
        for what in a.only.split(","):
            if what == "launch":
                record = launch_run(a, gpus)
            else:  # (launch's default: the cores per rank less one, per rank)
                record = baseline_run(a, gpus, a.workers if a.workers is not None else max(1, cores // gpus - 1))
            print(json.dumps(record), flush=True)
            if record.get("img_per_s"):
                best[what][gpus] = record["img_per_s"]
    summary: dict = {"what": "summary", "cores": cores,
                     **{f"{k}_{g}gpu": v for k, d in best.items() for g, v in d.items()}}
    for what, d in best.items():
        if d.get(1) and d.get(2):
            summary[f"{what}_2gpu_over_1gpu"] = round(d[2] / d[1], 3)
    for g in a.gpus:
        if best["launch"].get(g) and best["baseline"].get(g):
            summary[f"launch_over_baseline_{g}gpu"] = round(best["launch"][g] / best["baseline"][g], 3)
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
