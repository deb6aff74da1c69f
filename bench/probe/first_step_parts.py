"""Where the first training step of a CIFAR network goes in a fresh process, with cuDNN's autotuning on,
off, or limited (issue 15: time to first step). One GPU, one fresh process per (model, setting),
settings alternating; JSON lines.

    python bench/probe/first_step_parts.py                       # resnet18 @512, airbench @1024
    python bench/probe/first_step_parts.py --models resnet18 --repeats 1
    python bench/probe/first_step_parts.py --launch      # the same settings as whole `launch` commands

Per process: seconds from the start to each mark (torch imported, CUDA ready, model on the GPU, the
first forward, backward and fused SGD step, steps 2-3), whether torch._dynamo was imported by then,
and the steady eager step (ms, mean of 30 synced steps after those) with the same settings as the
launcher's step (bf16 autocast, channels_last, the recipe's augmentation, label-smoothed loss).
With --launch: `launch recipe=cifar10 gpus=[0] data.synthetic=true epochs=3 perf.compile=false` per
model with perf.cudnn_benchmark true and false (alternating, after one untimed run that fills the data
cache): seconds from the command to the first step, the timeline, and the captured step's img/s.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

BATCH = {"resnet18": 512, "airbench": 1024}
SETTINGS = ("benchmark_on", "benchmark_off", "benchmark_limit_1")


def child(model: str, setting: str) -> None:
    t0 = time.perf_counter()
    marks: dict[str, float] = {}

    def mark(name: str) -> None:
        torch.cuda.synchronize()
        marks[name] = round(time.perf_counter() - t0, 3)

    import torch

    from launcher.host.compose import config_for
    from launcher.recipes.cifar10 import Cifar10

    torch.cuda.set_device(0)
    torch.zeros(1, device="cuda")
    mark("cuda_ready")
    torch.backends.cudnn.benchmark = setting != "benchmark_off"
    if setting == "benchmark_limit_1":
        torch.backends.cudnn.benchmark_limit = 1
    recipe = Cifar10(config_for("recipe=cifar10", f"recipe.model={model}"))
    net = recipe.build_model(10).cuda().to(memory_format=torch.channels_last)
    loss_fn = recipe.loss()
    augment = recipe.augmentation()
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9, nesterov=True, fused=True)
    n = BATCH[model]
    x8 = torch.randint(0, 256, (n, 3, 32, 32), dtype=torch.uint8, device="cuda")
    y = torch.randint(0, 10, (n,), device="cuda")
    idx = torch.arange(n, device="cuda")
    gen = torch.Generator(device="cuda")
    gen.manual_seed(0)
    mark("model_on_gpu")

    def batch() -> torch.Tensor:
        x = augment(x8, gen, indices=idx, epoch=0)
        return (x.float() / 255.0).contiguous(memory_format=torch.channels_last)

    xb = batch()
    mark("augmented")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = loss_fn(net(xb), y)
    mark("first_forward")
    loss.backward()
    mark("first_backward")
    dynamo_before = "torch._dynamo" in sys.modules
    opt.step()
    opt.zero_grad(set_to_none=True)
    mark("first_optimizer_step")
    for _ in range(2):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_fn(net(batch()), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    mark("steps_2_3")
    steady = []
    for _ in range(30):
        t = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_fn(net(batch()), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        steady.append(time.perf_counter() - t)
    print(json.dumps({"what": "first_step_parts", "model": model, "batch": n, "setting": setting, **marks,
                      "dynamo_imported_before_opt_step": dynamo_before,
                      "dynamo_imported_after": "torch._dynamo" in sys.modules,
                      "steady_step_ms": round(1000 * sum(steady) / len(steady), 3),
                      "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                      "cudnn": torch.backends.cudnn.version(), "date": time.strftime("%Y-%m-%d")}), flush=True)


def launches(models: list[str], repeats: int) -> None:
    import os
    import tempfile
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1]))
    from launch_run import run_launch

    with tempfile.TemporaryDirectory(prefix="first-step-parts-") as cache:
        env = {**os.environ, "LAUNCH_CACHE_DIR": cache}
        for model in models:
            common = ("recipe=cifar10", "gpus=[0]", "data.synthetic=true", "perf.compile=false",
                      f"recipe.model={model}", f"batch_size={BATCH[model]}")
            run_launch(*common, "epochs=1", env=env)  # fills the data cache
            for _ in range(repeats):
                for benchmark in ("true", "false"):
                    run = run_launch(*common, "epochs=3", f"perf.cudnn_benchmark={benchmark}", env=env)
                    row = {"what": "first_step_launch", "model": model, "cudnn_benchmark": benchmark,
                           "exit_code": run.exit_code}
                    if run.ok:
                        steady = run.metrics[1:]
                        row.update(first_step_s=run.first_step_from_command_s(), startup=run.results["startup"],
                                   img_per_s=round(sum(r["img_per_s"] for r in steady) / len(steady)),
                                   device=run.results["devices"][0], torch=run.results["torch"])
                    else:
                        row["error"] = run.error_tail()
                    print(json.dumps({**row, "date": time.strftime("%Y-%m-%d")}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(BATCH))
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--launch", action="store_true", help="whole launch commands instead of the probe")
    args = parser.parse_args()
    if args.launch:
        launches(args.models, args.repeats)
        return
    for _ in range(args.repeats):
        for model in args.models:
            for setting in SETTINGS:
                subprocess.run([sys.executable, __file__, "--child", model, setting], check=False)


if __name__ == "__main__":
    if len(sys.argv) > 3 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3])
    else:
        main()
