"""A recipe's map-style Dataset of in-memory tensors through `launch`, against a Lightning Trainer fed by a
DataLoader with the same settings (issue 33: "the launcher adds no overhead to the generic path").

    python bench/lightning_dataset.py compare            # one GPU: CIFAR-shaped tensors, ResNet-18, both in one call
    python bench/lightning_dataset.py compare --device cpu --n 512 --eval-n 128 --batch 64 --epochs 2 \\
        --workers 1 --no-compile                          (the script itself checked on a CPU: a minute)

Both sides train the same network (a CIFAR ResNet-18, defined once in the recipe file this script writes) on
the same TensorDataset (--n samples of 3 x 32 x 32 float32 and int64 labels, in host memory): batch --batch,
SGD with Nesterov momentum (fused on CUDA), bf16 autocast, channels_last, torch.compile, cuDNN autotuned,
no evaluation until the end, shuffled each epoch.
  launch     `launch recipe=cifar_tensors` on that file (its `load` returns the two TensorDatasets; the
             launcher builds the DataLoader: --workers workers, pinned, persistent, prefetch_factor 4)
  lightning  `Trainer(precision="bf16-mixed", benchmark=True)` on a LightningModule over the same network,
             a DataLoader(shuffle=True, drop_last=True, --workers workers, pin_memory, persistent_workers,
             prefetch_factor=4); no logger, checkpointing or progress bar (each would only cost it time)
Throughput on both sides is the device clock from the start of an epoch's first step to the end of its last,
over the epochs after the first (which holds compilation); one JSON line per side, then the ratio.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
from launch_run import run_launch  # noqa: E402

RECIPE = '''"""CIFAR-shaped tensors held in memory, handed to launch as TensorDatasets (bench/lightning_dataset.py)."""
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.data import TensorDataset

from launcher.recipes import Recipe, RecipeConfig


def tensors(n, seed):
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 10, (n,), generator=g)
    x = torch.randn(n, 3, 32, 32, generator=g) + y.view(-1, 1, 1, 1) * 0.05  # (a little to learn)
    return TensorDataset(x, y)


class Block(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.skip = (nn.Sequential() if stride == 1 and cin == cout else
                     nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)))

    def forward(self, x):
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.skip(x))


def linear(num_classes=10):  # (a network that costs nothing: what is left is each side's own work per step)
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, num_classes))


def resnet18(num_classes=10):
    layers = [nn.Conv2d(3, 64, 3, 1, 1, bias=False), nn.BatchNorm2d(64), nn.ReLU()]
    cin = 64
    for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        layers += [Block(cin, cout, stride), Block(cout, cout, 1)]
        cin = cout
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, num_classes))


@dataclass
class CifarTensorsConfig(RecipeConfig):
    samples: int = 50000
    eval_samples: int = 10000


class CifarTensors(Recipe):
    Config = CifarTensorsConfig
    models = ("resnet18", "linear")

    def load(self):
        return tensors(self.hp.samples, 0), tensors(self.hp.eval_samples, 1)

    def num_classes(self, train):
        return 10

    def build_model(self, num_classes):
        return linear(num_classes) if self.hp.model == "linear" else resnet18(num_classes)
'''


def write_recipe(folder: Path) -> Path:
    path = folder / "cifar_tensors.py"
    path.write_text(RECIPE)
    return path


def run_launch_side(a: argparse.Namespace) -> dict:
    gpus = "[0]" if a.device == "cuda" else "[]"
    overrides = ["recipe=cifar_tensors", f"gpus={gpus}", f"batch_size={a.batch}", f"epochs={a.epochs}",
                 f"recipe.samples={a.n}", f"recipe.eval_samples={a.eval_n}", f"recipe.model={a.model}",
                 f"data.workers={a.workers}",
                 "data.worker_prefetch=4", "optim=sgd", f"lr={a.lr}", "eval.every=0", "progress=lines",
                 f"perf.compile={'false' if a.no_compile else 'true'}", *a.launch_args]
    run = run_launch(*overrides, files={"cifar_tensors.py": RECIPE}, timeout=a.timeout)
    record = {"what": "launch", "exit_code": run.exit_code, "wall_s": run.wall_s, "args": overrides[1:]}
    if not run.ok:
        return {**record, "error": run.error_tail(30)}
    rows = run.metrics[1:] or run.metrics
    rate = sum(r["samples_per_s"] for r in rows) / len(rows)
    return {**record, "samples_per_s": round(rate, 1), "compiled": run.results.get("compiled"),
            "per_epoch": [[round(r["samples_per_s"]), r.get("input_stall"), round(r["train_s"], 3),
                           r.get("host_issue_s")] for r in run.metrics],
            "device": (run.results.get("devices") or [None])[0], "torch": run.results.get("torch")}


def run_lightning_side(a: argparse.Namespace) -> dict:
    """The Lightning Trainer, in a process of its own (as a user runs it): this script with `lightning`."""
    import subprocess

    command = [sys.executable, __file__, "lightning", *sys.argv[2:]]
    started = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True, timeout=a.timeout)
    wall = round(time.perf_counter() - started, 2)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-30:]
        return {"what": "lightning", "exit_code": proc.returncode, "wall_s": wall, "error": tail}
    return {**json.loads(lines[-1]), "exit_code": 0, "wall_s": wall}


def lightning_main(a: argparse.Namespace) -> None:
    import torch
    from torch.utils.data import DataLoader

    try:
        import lightning as L
    except ImportError:  # (the older package name)
        import pytorch_lightning as L

    scratch = Path(tempfile.mkdtemp(prefix="bench-lightning-"))
    write_recipe(scratch)
    sys.path.insert(0, str(scratch))
    import cifar_tensors

    cuda = a.device == "cuda"
    torch.manual_seed(0)

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            net = getattr(cifar_tensors, a.model)(10)
            if cuda:
                net = net.to(memory_format=torch.channels_last)
            self.net = net if a.no_compile else torch.compile(net)

        def training_step(self, batch, batch_idx):
            x, y = batch
            if cuda:
                x = x.contiguous(memory_format=torch.channels_last)
            return torch.nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            extra = {"fused": True} if cuda else {}
            return torch.optim.SGD(self.parameters(), lr=a.lr, momentum=0.9, nesterov=True, weight_decay=5e-4,
                                   **extra)

    class Clock(L.Callback):
        """The device clock from the start of each epoch's first step to the end of its last."""

        def __init__(self):
            self.epochs: list[tuple[float, int]] = []
            self.steps = 0

        def _now(self):
            if cuda:
                event = torch.cuda.Event(enable_timing=True)
                event.record()
                return event
            return time.perf_counter()

        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            if batch_idx == 0:
                self.start, self.steps = self._now(), 0

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            self.steps += 1
            self.end = self._now()

        def on_train_epoch_start(self, trainer, module):
            if a.profile and trainer.current_epoch == 1:  # (the second epoch, as launch's profile=true)
                from torch.profiler import ProfilerActivity, profile

                self.profiler = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
                self.profiler.__enter__()

        def on_train_epoch_end(self, trainer, module):
            if getattr(self, "profiler", None) is not None:
                self.profiler.__exit__(None, None, None)
                self.profiler.export_chrome_trace(a.profile)
                self.profiler = None
            if cuda:
                torch.cuda.synchronize()
                span = self.start.elapsed_time(self.end) / 1000
            else:
                span = self.end - self.start
            self.epochs.append((span, self.steps))

    train = cifar_tensors.tensors(a.n, 0)
    workers = {"num_workers": a.workers, "persistent_workers": a.workers > 0}
    if a.workers > 0:
        workers["prefetch_factor"] = 4
    loader = DataLoader(train, batch_size=a.batch, shuffle=True, drop_last=True, pin_memory=cuda, **workers)
    clock = Clock()
    trainer = L.Trainer(accelerator="gpu" if cuda else "cpu", devices=1, max_epochs=a.epochs,
                        precision="bf16-mixed" if cuda else "32-true", benchmark=cuda, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, num_sanity_val_steps=0, callbacks=[clock])
    trainer.fit(Module(), loader)
    timed = clock.epochs[1:] or clock.epochs
    rate = sum(steps * a.batch / span for span, steps in timed) / len(timed)
    print(json.dumps({"what": "lightning", "samples_per_s": round(rate, 1), "lightning": L.__version__,
                      "per_epoch": [[round(steps * a.batch / span), round(span, 3)] for span, steps in clock.epochs],
                      "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["compare", "launch", "lightning"])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--n", type=int, default=50000)
    p.add_argument("--eval-n", type=int, default=10000)
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--workers", type=int, default=None, help="DataLoader workers (default: launch's: cores - 1)")
    p.add_argument("--lr", type=float, default=0.2)
    p.add_argument("--model", default="resnet18", choices=["resnet18", "linear"],
                   help="linear: a network that costs nothing, so each side's own work per step is what is timed")
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--timeout", type=float, default=400)
    p.add_argument("--profile", default=None,
                   help="lightning: torch.profiler over its second epoch, to this trace file")
    p.add_argument("--launch-args", nargs="*", default=[])
    a = p.parse_args()
    if a.workers is None:
        import os

        a.workers = max(0, len(os.sched_getaffinity(0)) - 1)
    if a.what == "lightning":
        lightning_main(a)
        return
    records = []
    if a.what in ("compare", "launch"):
        records.append(run_launch_side(a))
        print(json.dumps(records[-1]), flush=True)
    if a.what == "compare":
        records.append(run_lightning_side(a))
        print(json.dumps(records[-1]), flush=True)
        rates = {r["what"]: r.get("samples_per_s") for r in records}
        if all(rates.values()):
            print(json.dumps({"summary": "launch / lightning", "ratio": round(rates["launch"] / rates["lightning"], 3),
                              **rates}))


if __name__ == "__main__":
    main()
